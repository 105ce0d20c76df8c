"""A user's decision rules (``RewriteConfig.make(rules=[...])``, docs/rules.md): the worked
example of the page (``examples/user_rules.py``, shown there verbatim), where the rules run,
how the config, the plan text and the CLI carry their names, and the errors."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.cli import main as cli_main
from fxamp.ir import Decision

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "user_rules.py"
CPU_BF16 = "compute=bf16,target=cpu"


def _example():
    spec = importlib.util.spec_from_file_location("user_rules_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (its __main__ part runs only as a script)
    return module


ex = _example()


def _rewrite(rules=None, policy=CPU_BF16, **kwargs):
    model, inputs = ex.build()
    return model, inputs, fxamp.amp_rewrite(
        model, inputs, fxamp.RewriteConfig.make(policy=policy, rules=rules, **kwargs))


# -- the worked example ------------------------------------------------------------------
def test_the_page_shows_the_example_file_verbatim():
    page = (ROOT / "docs" / "rules.md").read_text()
    match = re.search(r"<!-- file: examples/user_rules\.py -->\n```python\n(.*?)```\n", page,
                      re.S)
    assert match, "docs/rules.md has no ```python block marked <!-- file: ... -->"
    assert match.group(1) == EXAMPLE.read_text()


def _by_hand(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The example model as CPU bf16 autocast computes it, but for the two multiplies that
    read a ``*_scale`` tensor, in FP32."""
    low = torch.bfloat16
    h = torch.relu(F.linear(x.to(low), model.up.weight.to(low), model.up.bias.to(low)))
    h = h.float() * model.gate_scale                    # user:keep_scales
    y = F.linear(h.to(low), model.down.weight.to(low), model.down.bias.to(low))
    return y.float() * model.out_scale                  # user:keep_scales


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_keep_scales_plans_scale_readers_fp32_the_rest_as_autocast_and_matches_by_hand(
        frontend):
    model, (x,), gm = _rewrite([ex.KeepScales()], frontend=frontend)
    _, _, plain = _rewrite(None, frontend=frontend)
    plan, autocast_plan = fxamp.plan_of(gm), fxamp.plan_of(plain)
    scaled = {name for name, p in plan.nodes.items() if p.rule == "user:keep_scales"}
    assert len(scaled) == 2 and all("mul" in plan.nodes[n].op for n in scaled)
    for name in scaled:
        p = plan.nodes[name]
        assert (p.dtype, p.inputs, p.reason) == (torch.float32, torch.float32,
                                                 "reads a *_scale tensor: kept in fp32")
        assert autocast_plan.nodes[name].dtype == torch.bfloat16  # autocast: bf16
    for name, p in plan.nodes.items():  # every other line is autocast's
        if name not in scaled:
            assert (p.dtype, p.rule) == (autocast_plan.nodes[name].dtype, "autocast"), name
    assert sum(p.dtype == torch.bfloat16 for p in plan.nodes.values()) >= 3  # up, relu, down
    assert "user:keep_scales" in plan.policy
    with torch.no_grad():
        out = gm(x)
        assert out.dtype == torch.float32 and torch.equal(out, _by_hand(model, x))
        with torch.autocast("cpu", torch.bfloat16):
            under_autocast = model(x).float()
    assert not torch.equal(out, under_autocast)  # the rule changed the numbers


# -- the config and the plan file ---------------------------------------------------------
def test_config_of_holds_the_rule_and_rewrites_the_same_plan():
    rule = ex.KeepScales()
    model, inputs, gm = _rewrite([rule])
    config = fxamp.config_of(gm)
    assert config.rules == (rule,) and config.policy.rules == ("user:keep_scales",)
    again = fxamp.amp_rewrite(model, inputs, config=config)
    assert fxamp.plan_of(again) == fxamp.plan_of(gm)
    assert fxamp.config_of(again).rules == (rule,)


def test_plan_text_round_trips_and_diffs_the_user_rule_name(tmp_path):
    _, _, gm = _rewrite([ex.KeepScales()])
    _, _, plain = _rewrite(None)
    plan = fxamp.plan_of(gm)
    path = tmp_path / "plan.txt"
    plan.save(str(path))
    loaded = fxamp.Plan.load(str(path))
    assert loaded == plan and loaded.nodes["mul"].rule == "user:keep_scales"
    text = fxamp.diff(fxamp.plan_of(plain), loaded)
    assert "user:keep_scales" in text and "mul" in text


def test_reapplying_a_plan_without_its_rule_names_what_is_missing_and_its_advice_works(
        tmp_path):
    model, inputs, gm = _rewrite([ex.KeepScales()])
    path = tmp_path / "plan.txt"
    fxamp.plan_of(gm).save(str(path))
    saved = fxamp.Plan.load(str(path))
    with pytest.raises(fxamp.RuleError, match=r"user:keep_scales.*rules=\[") as err:
        fxamp.amp_rewrite(model, inputs, saved.policy)
    assert "no rule object of that name" in str(err.value)
    # the advice: pass the rule object too
    again = fxamp.amp_rewrite(
        model, inputs, fxamp.RewriteConfig.make(policy=saved.policy, rules=[ex.KeepScales()]))
    assert fxamp.plan_of(again).nodes == saved.nodes


def test_policy_string_names_user_rules_and_refuses_a_bad_name():
    pol = fxamp.Policy.parse("compute=bf16,user:keep_scales,fp32:head.*")
    assert pol.rules == ("user:keep_scales",)
    assert fxamp.Policy.parse(str(pol)) == pol
    with pytest.raises(fxamp.PolicyError, match="'user:r1x'"):
        fxamp.Policy.parse("user:1x")
    assert fxamp.Policy.parse("user:r1x").rules == ("user:r1x",)  # (its advice)


def test_in_place_planned_on_first_call_runs_the_rule():
    model, (x,) = ex.build()
    fxamp.amp_rewrite(model,
                      config=fxamp.RewriteConfig.make(policy=CPU_BF16, rules=[ex.KeepScales()]),
                      inplace=True)
    model(x)
    assert fxamp.plan_of(model).nodes["mul"].rule == "user:keep_scales"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.res_scale = nn.Linear(8, 8), nn.Parameter(torch.tensor(1.0039))

    def forward(self, x):
        return x + self.lin(x) * self.res_scale


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_block_mode_plans_each_block_with_the_rule():
    """In place without example inputs, a model of repeated blocks keeps them as modules,
    each planned on its first call with its own graph: the rule runs on each."""
    model = Blocks()
    fxamp.amp_rewrite(model,
                      config=fxamp.RewriteConfig.make(policy=CPU_BF16, rules=[ex.KeepScales()]),
                      inplace=True)
    model(torch.randn(2, 8))
    plan = fxamp.plan_of(model)
    assert "user:keep_scales" in plan.policy
    assert plan.nodes["layers.0/mul"].rule == "user:keep_scales"
    for block in model.layers:
        p = fxamp.plan_of(block).nodes["mul"]
        assert (p.dtype, p.rule) == (torch.float32, "user:keep_scales")


# -- where the rules run: precedence ------------------------------------------------------
class RmsNet(nn.Module):
    """A hand-written RMSNorm whose eps fp16 loses: norm_eps fences its statistics."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-12))


class LowMean(fxamp.DecisionRule):
    name = "user:low_mean"

    def applies(self, node):
        return self.label(node) == "Tensor.mean"

    def decide(self, node):
        return {node: self.verdict(self.policy.compute, "mean kept low on purpose")}


def test_a_user_rule_wins_over_a_numerics_rule_and_a_policy_override_over_both():
    x = torch.randn(2, 8)
    gm = fxamp.amp_rewrite(RmsNet(), (x,), "compute=fp16,target=cpu")
    assert fxamp.plan_of(gm).nodes["mean"].rule == "norm_eps"
    gm = fxamp.amp_rewrite(RmsNet(), (x,),
                           fxamp.RewriteConfig.make(policy="compute=fp16,target=cpu",
                                                    rules=[LowMean()]))
    nodes = fxamp.plan_of(gm).nodes
    assert (nodes["mean"].dtype, nodes["mean"].rule) == (torch.float16, "user:low_mean")
    assert nodes["add"].rule == "norm_eps"  # the rest of the norm stays fenced
    gm = fxamp.amp_rewrite(RmsNet(), (x,),
                           fxamp.RewriteConfig.make(policy="compute=fp16,target=cpu,fp32:mean",
                                                    rules=[LowMean()]))
    nodes = fxamp.plan_of(gm).nodes
    assert (nodes["mean"].dtype, nodes["mean"].rule) == (torch.float32, "user")


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.neg_scale = nn.Linear(8, 8), nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        a = self.lin(x)
        return torch.where(a > 0, a, a * self.neg_scale)


def test_the_joins_rule_sees_what_a_user_rule_decided():
    """The user rule makes one input of the where FP32; the decide group's next sweep
    promotes the where (rule joins)."""
    gm = fxamp.amp_rewrite(Gated(), (torch.randn(2, 8),),
                           fxamp.RewriteConfig.make(policy=CPU_BF16, rules=[ex.KeepScales()]))
    nodes = fxamp.plan_of(gm).nodes
    assert (nodes["mul"].dtype, nodes["mul"].rule) == (torch.float32, "user:keep_scales")
    assert (nodes["where"].dtype, nodes["where"].rule) == (torch.float32, "joins")


# -- errors --------------------------------------------------------------------------------
def test_an_object_that_is_no_decision_rule_is_refused_naming_it():
    model, inputs = ex.build()
    with pytest.raises(fxamp.RuleError, match="not a fxamp.DecisionRule"):
        fxamp.amp_rewrite(model, inputs,
                          fxamp.RewriteConfig.make(policy=CPU_BF16, rules=[lambda node: True]))
    with pytest.raises(fxamp.RuleError, match=r"rules=\[KeepScales\(\)\]"):
        fxamp.amp_rewrite(model, inputs,
                          fxamp.RewriteConfig.make(policy=CPU_BF16, rules=[ex.KeepScales]))
    # (its advice)
    fxamp.amp_rewrite(model, inputs,
                      fxamp.RewriteConfig.make(policy=CPU_BF16, rules=[ex.KeepScales()]))


def test_a_rule_without_a_user_name_is_refused_with_the_name_to_use():
    with pytest.raises(fxamp.RuleError, match="name it 'user:keep_scales'"):
        class Unnamed(fxamp.DecisionRule):  # noqa: F841 - refused when the class is made
            name = "keep_scales"

    class Named(ex.KeepScales):  # (the advice)
        name = "user:keep_scales"

    model, inputs = ex.build()
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(policy=CPU_BF16, rules=[Named()]))
    assert fxamp.plan_of(gm).nodes["mul"].rule == "user:keep_scales"
    with pytest.raises(fxamp.RuleError, match="two rules are named 'user:keep_scales'"):
        fxamp.amp_rewrite(model, inputs,
                          fxamp.RewriteConfig.make(policy=CPU_BF16,
                                                   rules=[ex.KeepScales(), Named()]))


class Returns(fxamp.DecisionRule):
    """A rule deciding every ``mul`` with what it was made with."""

    name = "user:returns"

    def __init__(self, make):
        super().__init__()
        self.make = make

    def applies(self, node):
        return self.label(node) == "operator.mul"

    def decide(self, node):
        return self.make(self, node)


@pytest.mark.parametrize("make, problem", [
    (lambda rule, node: None, "decide returned None"),
    (lambda rule, node: {node: torch.float32}, "not a Decision"),
    (lambda rule, node: {node: Decision(torch.float32, "autocast", "x")},
     "named 'autocast', not the rule's own name"),
    (lambda rule, node: {node: rule.verdict(torch.int32, "x")}, "casts inputs to torch.int32"),
    (lambda rule, node: {node: rule.verdict(torch.float32, " ")}, "has no reason"),
    (lambda rule, node: {node.args[1]: rule.verdict(torch.float32, "x")},
     "get_attr node gate_scale"),
    (lambda rule, node: 1 / 0, "decide\\(node\\) raised ZeroDivisionError"),
])
def test_an_invalid_decision_raises_rule_error_naming_the_rule_and_the_node(make, problem):
    model, inputs = ex.build()
    with pytest.raises(fxamp.RuleError, match=problem) as err:
        fxamp.amp_rewrite(model, inputs,
                          fxamp.RewriteConfig.make(policy=CPU_BF16, frontend="fx",
                                                   rules=[Returns(make)]))
    assert "rule 'user:returns' (Returns) at node mul " in str(err.value)


# -- the command line ----------------------------------------------------------------------
def test_cli_check_names_a_missing_rule_and_passes_with_rule(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = str(tmp_path / "plan.txt")
    model = ["examples/user_rules.py:build", "--dtype", "bf16", "--target", "cpu"]
    rule = ["--rule", "examples/user_rules.py:KeepScales"]
    assert cli_main(["check", *model, *rule, "--plan", plan, "--update"]) == 0
    assert "user:keep_scales" in Path(plan).read_text()
    capsys.readouterr()
    assert cli_main(["check", *model, "--plan", plan]) == 1
    err = capsys.readouterr().err
    assert "made with the user rule user:keep_scales" in err and "--rule MODULE:NAME" in err
    assert cli_main(["check", *model, *rule, "--plan", plan]) == 0  # (the advice)
