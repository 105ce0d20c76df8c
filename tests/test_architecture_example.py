"""The worked example of docs/architecture.md ("Adding a decision rule"): a rule that keeps
every ``exp`` in fp32, in fx and torch.export spellings alike. The class below is the one the
document shows; keep the two in step."""
from __future__ import annotations

from typing import Dict

import torch
import torch.fx as fx
import torch.nn as nn

from fxamp import ir, ops
from fxamp.ir import Decision
from fxamp.passes.annotate import annotate
from fxamp.passes.manager import PassContext
from fxamp.passes.rule import DecisionRule, rule_pass
from fxamp.policy import Policy
from fxamp.frontends.fx import trace


# -- the example rule (docs/architecture.md) ---------------------------------------------
class ExpInFp32Rule(DecisionRule):
    """exp overflows fp16 past 11.1: every exp planned in the low dtype runs in fp32."""

    name = ir.Rule.SOFTMAX  # in the tree: its own member, EXP_FP32, at the end of ir.Rule

    def applies(self, node: fx.Node) -> bool:
        return ops.name(node) == "exp"  # torch.exp, x.exp(), aten.exp.default

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        plan = ir.precision(node)
        if plan is None or plan.dtype != self.policy.compute:
            return {}  # already fp32 (or not floating): nothing to decide
        return {node: self.verdict(torch.float32, "exp overflows the low dtype past 11.1")}


# -- its test ---------------------------------------------------------------------------
class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).exp() * torch.exp(x)


def test_example_rule_alone_and_as_a_pass():
    model, x = Gate(), torch.randn(2, 8)
    pol = Policy.parse("compute=bf16,target=cpu")
    gm = trace(model, (), "fx")
    annotate(gm, (x,), pol)
    ctx = PassContext(pol, (x,))
    exp, exp_1 = (n for n in gm.graph.nodes if ops.name(n) == "exp")
    rule = ExpInFp32Rule(gm, ctx)
    assert rule.applies(exp) and rule.applies(exp_1)
    assert not rule.applies(next(n for n in gm.graph.nodes if n.op == "call_module"))
    # the exp of the bf16 Linear output is bf16 under autocast: decided fp32
    assert ir.precision(exp).dtype == torch.bfloat16
    assert rule.decide(exp)[exp].inputs == torch.float32
    assert rule.decide(exp_1) == {}  # exp of the fp32 input is fp32 already
    # as a pass: the decision goes into the IR; the next annotate run makes it the plan line
    assert rule_pass(ExpInFp32Rule)(gm, ctx).modified
    annotate(gm, (x,), pol)
    p = ir.precision(exp)
    assert (p.dtype, p.inputs, p.rule) == (torch.float32, torch.float32, "softmax")
    assert not rule_pass(ExpInFp32Rule)(gm, ctx).modified  # a fixpoint: nothing more to do
