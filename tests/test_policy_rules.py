"""Numerics rules switched one at a time in the policy (``off:RULE``), and ``numerics=off``
as the shorthand for all of them."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.ir import Rule
from fxamp.policy import NUMERICS_RULES, Policy


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * 2


class AllRules(nn.Module):
    """One graph on which each of the five numerics rules decides something (fp16, cuda)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = self.fc(x)
        e = torch.exp(h)
        p = e / e.sum(-1, keepdim=True)                      # softmax
        d = h - h.mean(-1, keepdim=True)
        n = d / torch.sqrt((d * d).mean(-1, keepdim=True) + 1e-12)  # norm_eps
        c = _Twice.apply(h)                                   # custom_ops
        j = torch.cat([h, x.exp()], -1)                       # joins
        o = self.fc2(p + n + c)
        return (o * o).mean(), j                              # loss


@pytest.fixture(scope="module")
def model_and_inputs():
    torch.manual_seed(0)
    return AllRules(), (torch.randn(2, 8),)


class MaskedScores(nn.Module):
    """Scores with an additive padding mask filled with finfo(float32).min: the deployment
    plan's rule (mask_fill, target tensorrt) decides here."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        add = torch.where(mask.bool(), torch.zeros(()), torch.finfo(torch.float32).min)
        return torch.softmax(x @ x.transpose(-1, -2) + add, -1)


#: rules of a deployment plan only, checked on MaskedScores with target=tensorrt
DEPLOY_RULES = ("mask_fill",)


def _case(rule: str, model_and_inputs) -> tuple:
    """(policy prefix, model, inputs) on which ``rule`` decides something."""
    if rule in DEPLOY_RULES:
        torch.manual_seed(0)
        mask = torch.ones(2, 4, 4)
        mask[1, :, 2:] = 0
        return "placement=off,target=tensorrt", MaskedScores(), (torch.randn(2, 4, 8), mask)
    return ("placement=off,target=cuda", *model_and_inputs)


def _rule_lines(policy: str, model: nn.Module, inputs: tuple) -> Dict[str, List[str]]:
    """rule -> the plan's node lines with that rule (numerics rules only)."""
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, inputs, policy))
    out: Dict[str, List[str]] = {rule: [] for rule in NUMERICS_RULES}
    for line in plan.to_text().splitlines():
        cols = line.split()
        if len(cols) > 5 and not line.startswith("#") and cols[5] in out:
            out[cols[5]].append(" ".join(cols))  # column widths follow the longest name
    return out


def test_numerics_rules_are_plan_rule_names():
    assert [Rule(name).value for name in NUMERICS_RULES] == list(NUMERICS_RULES)


@pytest.mark.parametrize("rule", NUMERICS_RULES)
def test_every_rule_decides_something_by_default(rule, model_and_inputs):
    policy, model, inputs = _case(rule, model_and_inputs)
    lines = _rule_lines(policy, model, inputs)
    assert lines[rule], lines


@pytest.mark.parametrize("rule", NUMERICS_RULES)
def test_one_rule_switched_off_changes_only_its_lines(rule, model_and_inputs):
    policy, model, inputs = _case(rule, model_and_inputs)
    before = _rule_lines(policy, model, inputs)
    after = _rule_lines(f"{policy},off:{rule}", model, inputs)
    assert before[rule] and not after[rule]
    for other in NUMERICS_RULES:
        if other != rule:
            assert after[other] == before[other], other


@pytest.mark.parametrize("rule", NUMERICS_RULES)
def test_one_rule_off_keeps_the_output_dtype_and_round_trips(rule):
    p = Policy.parse(f"compute=bf16,off:{rule}")
    assert p.output_dtype is torch.float32 and p.numerics
    assert not p.runs(rule) and all(p.runs(r) for r in NUMERICS_RULES if r != rule)
    assert str(p) == f"compute=bf16,target=cuda,off:{rule}"
    assert Policy.parse(str(p)) == p


def test_numerics_off_is_the_shorthand_for_every_rule_and_output_keep(model_and_inputs):
    p = Policy.parse("numerics=off")
    assert not any(p.runs(r) for r in NUMERICS_RULES) and p.output_dtype is None
    assert str(p) == "compute=fp16,target=cuda,numerics=off"
    every = ",".join(f"off:{r}" for r in NUMERICS_RULES)
    model, inputs = model_and_inputs
    short = fxamp.plan_of(fxamp.amp_rewrite(model, inputs, "numerics=off"))
    long = fxamp.plan_of(fxamp.amp_rewrite(model, inputs, every + ",output=keep"))
    body = [line for line in short.to_text().splitlines() if not line.startswith("# policy")]
    assert body == [line for line in long.to_text().splitlines()
                    if not line.startswith("# policy")]
    # numerics=on turns the rules back on; an off: after numerics=off changes nothing
    assert Policy.parse(every + ",numerics=on").rules_off == frozenset()
    assert Policy.parse("numerics=off,off:joins") == p


@pytest.mark.parametrize("text, match", [
    ("off:join", r"unknown numerics rule 'join' \(did you mean 'joins'\?\).*softmax, "
                 "custom_ops, norm_eps, loss, joins, mask_fill"),
    ("off:banana", "off:RULE takes softmax, custom_ops, norm_eps, loss, joins, mask_fill"),
    ("numeric=off", r"unknown policy key 'numeric' \(did you mean 'numerics'\?\).*valid "
                    "keys: compute"),
])
def test_rule_and_key_typos_raise_policy_errors_with_suggestions(text, match):
    with pytest.raises(fxamp.FxampError, match=match):
        Policy.parse(text)


def test_a_policy_built_with_an_unknown_rule_is_refused():
    with pytest.raises(fxamp.FxampError, match="unknown numerics rule 'nope'"):
        Policy(rules_off=frozenset({"nope"}))
