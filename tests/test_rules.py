"""Each decision rule object alone: made for one traced graph whose IR annotate filled (a
real fake-tensor run, no pipeline), asked ``applies`` / ``decide`` node by node. What the
rules decide inside whole rewrites is tested in test_pass_*.py."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxamp import ir
from fxamp.ir import Rule
from fxamp.passes.annotate import annotate
from fxamp.passes.autocast_rules import (AutocastRule, FixedRule, GraphInputRule, RuntimeRule,
                                         UserOverrideRule)
from fxamp.passes.custom_ops import CustomOpsRule
from fxamp.passes.joins import JoinsRule
from fxamp.passes.loss import LossRule
from fxamp.passes.manager import PassContext
from fxamp.passes.norm_eps import NormEpsRule
from fxamp.passes.placement import PlacementRule
from fxamp.passes.ranges import RangesRule
from fxamp.passes.softmax import SoftmaxRule
from fxamp.plan import RangeStats
from fxamp.policy import Policy
from fxamp.frontends.fx import trace

FP16, FP32 = torch.float16, torch.float32


def annotated(model: nn.Module, inputs: tuple, policy: str) -> tuple:
    """(gm, ctx): ``model`` traced by fxamp's fx front end, its IR filled by annotate."""
    pol = Policy.parse(policy)
    gm = trace(model, (), "fx")
    annotate(gm, inputs, pol)
    return gm, PassContext(pol, inputs)


def node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def decided(rule, gm: fx.GraphModule) -> dict:
    """{node name: (inputs dtype, rule, reason)} of everything ``rule`` decides on ``gm``."""
    out = {}
    for n in gm.graph.nodes:
        if rule.applies(n):
            out.update({m.name: (d.inputs, d.rule, d.reason) for m, d in rule.decide(n).items()})
    return out


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-12)


def test_norm_eps_rule_fences_the_statistics_chain_of_a_tiny_eps():
    gm, ctx = annotated(RMSNorm(), (torch.randn(2, 8),), "compute=fp16,target=cuda")
    rule = NormEpsRule(gm, ctx)
    assert rule.applies(node(gm, "add")) and not rule.applies(node(gm, "x"))
    got = decided(rule, gm)
    assert set(got) == {"mul", "mean", "add", "rsqrt", "mul_1"}
    assert {(d, r) for d, r, _ in got.values()} == {(FP32, Rule.NORM_EPS)}
    assert "eps=1e-12" in got["add"][2]
    assert rule.decide(node(gm, "lin")) == {}  # low, but no eps addition


class AbsError(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return (self.a(x) - self.b(x)).abs().mean()


def test_loss_rule_fences_a_hand_written_loss_from_its_terms():
    gm, ctx = annotated(AbsError(), (torch.randn(2, 8),), "compute=fp16,target=cuda")
    assert ir.precision(node(gm, "mean")).dtype == FP16  # autocast: all fp16
    got = decided(LossRule(gm, ctx), gm)
    assert set(got) == {"mean", "abs_1"}
    assert all(d == FP32 and r == Rule.LOSS for d, r, _ in got.values())


class ConvAndUpsample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        up = F.interpolate(x, scale_factor=2.0, mode="bilinear")
        return torch.cat([self.conv(up), up], dim=1)


def test_joins_rule_promotes_a_mixed_dtype_cat():
    gm, ctx = annotated(ConvAndUpsample(), (torch.randn(1, 3, 4, 4),),
                        "compute=fp16,target=cuda")
    rule = JoinsRule(gm, ctx)
    assert [n.name for n in gm.graph.nodes if rule.applies(n)] == ["cat"]
    (inputs, r, reason), = decided(rule, gm).values()
    assert (inputs, r) == (FP32, Rule.JOINS) and "promoted to fp32" in reason


def test_ranges_rule_keeps_a_value_past_the_low_range_in_fp32():
    gm, ctx = annotated(RMSNorm(), (torch.randn(2, 8),), "compute=fp16,target=cuda")
    ctx.ranges = {"lin": RangeStats(max_abs=1e6, underflow=0.0, nonfinite=0),
                  "mean": RangeStats(max_abs=1.0, underflow=0.0, nonfinite=0)}
    rule = RangesRule(gm, ctx)
    assert rule.applies(node(gm, "lin")) and not rule.applies(node(gm, "add"))  # no stats
    got = decided(rule, gm)
    assert list(got) == ["lin"] and got["lin"][:2] == (FP32, Rule.RANGES)
    assert "reaches 1e+06" in got["lin"][2]


class NeedsFp32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class WithCustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return NeedsFp32.apply(self.lin(x))


def test_custom_ops_rule_gives_an_opaque_function_fp32_inputs():
    gm = trace(WithCustomFunction(), (), "fx")  # runs before annotate: needs no IR
    rule = CustomOpsRule(gm, PassContext(Policy.parse("compute=fp16,target=cpu")))
    got = decided(rule, gm)
    assert list(got) == ["needs_fp32_apply"]
    assert got["needs_fp32_apply"][:2] == (FP32, Rule.CUSTOM_OPS)


class HandSoftmax(nn.Module):
    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)


def test_softmax_rule_replaces_a_hand_written_softmax_by_the_fused_call_in_fp32():
    gm = trace(HandSoftmax(), (), "fx")  # runs before annotate: needs no IR
    rule = SoftmaxRule(gm, PassContext(Policy.parse("compute=fp16,target=cuda")))
    final = node(gm, "truediv")
    assert [n.name for n in gm.graph.nodes if rule.applies(n)] == ["truediv"]
    d = rule.decide(final)[final]
    assert (d.inputs, d.rule) == (FP32, Rule.SOFTMAX) and "exp overflows fp16" in d.reason
    new = rule.rewrite(final)
    assert (new.name, new.target) == ("truediv", torch.softmax)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]


class UpsampleConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=4, mode="nearest"))


def test_placement_rule_moves_an_enlarging_follow_op_into_the_low_dtype():
    gm, ctx = annotated(UpsampleConv(), (torch.randn(2, 4, 8, 8),),
                        "compute=bf16,target=cpu")
    rule = PlacementRule(gm, ctx)
    got = decided(rule, gm)
    assert list(got) == ["interpolate"]
    assert got["interpolate"][:2] == (torch.bfloat16, Rule.PLACEMENT)
    assert not rule.applies(node(gm, "conv"))


def test_annotate_rules_alone():
    gm, ctx = annotated(RMSNorm(), (torch.randn(2, 8),), "compute=fp16,target=cuda,fp32:rsqrt")
    lin, add, rsqrt, x = (node(gm, n) for n in ("lin", "add", "rsqrt", "x"))
    auto = AutocastRule(gm, ctx)
    d = auto.decision(lin, (), {})
    assert (d.inputs, d.rule, d.label) == (FP16, Rule.AUTOCAST, "nn.Linear")
    assert "lower-precision list for cuda" in d.reason
    assert auto.decision(add, (), {}).reason == "on no autocast list: follows its inputs"
    user = UserOverrideRule(gm, ctx)
    assert user.applies(rsqrt) and not user.applies(add)
    assert user.decide(rsqrt)[rsqrt].rule == Rule.USER and \
        user.decide(rsqrt)[rsqrt].inputs == FP32
    assert GraphInputRule(gm, ctx).applies(x) and not GraphInputRule(gm, ctx).applies(lin)
    fixed = FixedRule(gm, ctx)
    assert not fixed.applies(add)
    ir.fix(add, FP32, Rule.NORM_EPS, "test")
    assert fixed.decision(add, (), {}).rule == Rule.NORM_EPS
    assert not RuntimeRule(gm, ctx).applies(lin)


def test_rule_words_are_the_plan_words():
    assert [str(r) for r in (Rule.AUTOCAST, Rule.USER, Rule.RUNTIME, Rule.BANNED)] == \
        ["autocast", "user", "runtime", "banned"]
    assert f"{Rule.NORM_EPS:<9}|" == "norm_eps |" and {"joins"} == {Rule.JOINS}
