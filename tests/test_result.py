"""One frozen result per rewrite, under one attribute; rules are ir.Rule members; the Rule
enum only grows at its end."""
import dataclasses

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.ir import Rule
from fxamp.passes.rule import DecisionRule
from fxamp.result import RESULT, Rewritten, config_of, result_of

BF16 = dict(target="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("inplace", [False, True])
def test_one_frozen_result_under_one_attribute(inplace):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),), inplace=inplace,
                           config=fxamp.RewriteConfig.make(**BF16))
    result = result_of(gm)
    assert isinstance(result, Rewritten) and result.plan is fxamp.plan_of(gm)
    assert result.config is config_of(gm) and result.policy == result.config.policy
    assert result.source == "nn.Sequential"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.plan = None
    graph_reads = {str(n.target) for n in fxamp.rewritten(gm).graph.nodes
                   if n.op == "get_attr"}
    names = {k for k in vars(gm) if k.startswith("fxamp") and k not in graph_reads}
    assert names == {RESULT}  # (besides what the graph itself reads)


def test_a_rule_must_name_a_rule_member_or_a_user_word():
    with pytest.raises(fxamp.RuleError, match="is not a user rule name.*name it 'user:heal'"):
        class Bad(DecisionRule):  # noqa: F841 - the class statement is the test
            name = "heal"


def test_the_rule_enum_only_grows_at_its_end():
    first = ["autocast", "user", "runtime", "banned", "nested", "norm_eps", "loss", "joins",
             "softmax", "custom_ops", "ranges", "placement", "search", "bisect", "deploy",
             "heal"]
    assert [r.value for r in Rule][:len(first)] == first
