"""The stable softmax pass (rule "softmax").

Hand-written softmax, log(softmax) and log(sum(exp)) over fp16 logits overflow (exp past 11.1)
or underflow (log of a rounded probability) under plain ``torch.autocast("cpu", fp16)`` and
with ``model.half()``; after ``fxamp.amp_rewrite`` each pattern is one softmax / log_softmax /
logsumexp node computed in FP32 and the output is close to the FP32 model's. Near misses are
left alone: their plan and output are exactly what ``policy="numerics=off"`` (autocast) gives.
"""
from __future__ import annotations

import copy
import logging
import math
from typing import Callable, Dict, List

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.frontends.fx import trace as fxamp_trace

log = logging.getLogger(__name__)

FP16 = torch.float16


# ---------------------------------------------------------------------------------------
# the hand-written heads (logits z -> output), each a module-level function fx traces into
# ---------------------------------------------------------------------------------------
def softmax_two_exps(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)


def softmax_shared_exp_method(z: torch.Tensor) -> torch.Tensor:
    e = z.exp()
    return e / e.sum(-1, keepdim=True)


def softmax_torch_sum(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z)
    return e / torch.sum(e, dim=-1, keepdim=True)


def softmax_div_positive_dim(z: torch.Tensor) -> torch.Tensor:
    return torch.div(z.exp(), z.exp().sum(dim=1, keepdim=True))


def softmax_dim0(z: torch.Tensor) -> torch.Tensor:
    e = z.exp()
    return e / e.sum(0, keepdim=True)


def log_torch_softmax(z: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.softmax(z, -1))


def log_f_softmax(z: torch.Tensor) -> torch.Tensor:
    return torch.log(F.softmax(z, dim=1))


def log_method_softmax(z: torch.Tensor) -> torch.Tensor:
    return z.softmax(-1).log()


def lse_torch(z: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.sum(torch.exp(z), -1))


def lse_method_keepdim(z: torch.Tensor) -> torch.Tensor:
    return z.exp().sum(-1, keepdim=True).log()


def lse_mixed_dim0(z: torch.Tensor) -> torch.Tensor:
    return torch.log(z.exp().sum(0))


# near misses: never a softmax / log_softmax / logsumexp of one tensor over one dim
def miss_different_inputs(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(z) / torch.exp(z * 0.5).sum(-1, keepdim=True)


def miss_no_keepdim(z: torch.Tensor) -> torch.Tensor:
    e = z.exp()  # square logits: (16, 16) / (16,) broadcasts over the wrong dim
    return e / e.sum(-1)


def miss_two_dims(z: torch.Tensor) -> torch.Tensor:
    e = z.exp()
    return e / e.sum((0, 1), keepdim=True)


def miss_reversed(z: torch.Tensor) -> torch.Tensor:
    e = z.exp()
    return e.sum(-1, keepdim=True) / e


def miss_log_sigmoid(z: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.sigmoid(z))


def miss_log_mean_exp(z: torch.Tensor) -> torch.Tensor:
    return torch.log(z.exp().mean(-1))


def miss_log_sum_all(z: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.exp(z).sum())


def miss_softmax_dtype(z: torch.Tensor) -> torch.Tensor:
    return torch.log(F.softmax(z, dim=-1, dtype=torch.float32))


def miss_rounding_div(z: torch.Tensor) -> torch.Tensor:
    e = z.exp()
    return torch.div(e, e.sum(-1, keepdim=True), rounding_mode="floor")


class Head(nn.Module):
    """logits = fc(x) (FP16 under autocast, like any classifier), then a hand-written head."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], n: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.head = head
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(n) + 0.02 * torch.randn(n, n))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error vs the FP32 reference (inf or nan when the output has them)."""
    return (out.float() - ref).abs().max().item()


def _variants(model: nn.Module, x: torch.Tensor) -> Dict[str, float]:
    """Max abs error vs FP32 of: plain CPU autocast fp16, model.half(), fxamp (cpu, fp16)."""
    ref = model(x)
    with torch.autocast("cpu", dtype=FP16):
        autocast = model(x)
    half = copy.deepcopy(model).half()(x.half())
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=FP16, target="cpu"))
    out = gm(x)
    assert out.dtype == torch.float32
    errors = {"scale": ref.abs().max().item(), "autocast": _err(autocast, ref),
              "half": _err(half, ref), "fxamp": _err(out, ref)}
    log.info("%s: %s", model.head.__name__, errors)
    return errors


def _final_name(model: nn.Module) -> str:
    """The name of the node feeding the output in the traced source graph."""
    out = next(n for n in fxamp_trace(model).graph.nodes if n.op == "output")
    return out.args[0].name


_EXP_SUM = {torch.exp, torch.sum, "exp", "sum"}


def _pattern_ops(gm: fx.GraphModule) -> List[str]:
    return [n.name for n in gm.graph.nodes
            if n.op in ("call_function", "call_method") and n.target in _EXP_SUM]


def _check_rewritten(model: nn.Module, x: torch.Tensor, op: str, target: str = "cpu") -> None:
    name = _final_name(model)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=FP16, target=target))
    gm.graph.lint()
    plan = fxamp.plan_of(gm)
    p = plan.nodes.get(name)
    assert p is not None, f"no plan entry {name!r}; plan:\n{plan.to_text()}"
    assert (p.rule, p.op, p.dtype, p.inputs) == ("softmax", op, torch.float32, torch.float32), \
        plan.to_text()
    assert "replaced by" in p.reason and "FP32" in p.reason, p.reason
    assert [n for n, q in plan.nodes.items() if q.rule == "softmax"] == [name], plan.to_text()
    assert not _pattern_ops(gm), f"exp/sum nodes left: {_pattern_ops(gm)}\n{gm.code}"
    assert not any(q.op in ("torch.exp", "Tensor.exp", "torch.sum", "Tensor.sum",
                            "F.softmax", "torch.softmax", "Tensor.softmax")
                   for q in plan.nodes.values() if q.rule != "softmax"), plan.to_text()


# ---------------------------------------------------------------------------------------
# the patterns
# ---------------------------------------------------------------------------------------
SOFTMAX_HEADS = [softmax_two_exps, softmax_shared_exp_method, softmax_torch_sum,
                 softmax_div_positive_dim, softmax_dim0]


@pytest.mark.parametrize("head", SOFTMAX_HEADS, ids=lambda f: f.__name__)
def test_hand_written_softmax_is_stable(head: Callable) -> None:
    torch.manual_seed(0)
    model = Head(head)
    x = 12.0 + 2.0 * torch.randn(8, 16)  # logits around 12: exp overflows fp16 (max 65504)
    e = _variants(model, x)
    msg = f"max abs error vs FP32 (outputs up to {e['scale']:.3g}): {e}"
    assert not math.isfinite(e["autocast"]) and not math.isfinite(e["half"]), msg
    assert e["fxamp"] <= 1e-2 * e["scale"], msg
    _check_rewritten(model, x, "torch.softmax")


@pytest.mark.parametrize("head", [log_torch_softmax, log_f_softmax, log_method_softmax],
                         ids=lambda f: f.__name__)
def test_log_of_softmax_is_stable(head: Callable) -> None:
    torch.manual_seed(1)
    model = Head(head)
    x = 8.0 * torch.randn(8, 16)  # logits spread past 17: fp16 probabilities round to 0
    e = _variants(model, x)
    msg = f"max abs error vs FP32 (outputs up to {e['scale']:.3g}): {e}"
    assert not math.isfinite(e["autocast"]) and not math.isfinite(e["half"]), msg
    assert e["fxamp"] <= 1e-2 * e["scale"], msg
    _check_rewritten(model, x, "torch.log_softmax")


@pytest.mark.parametrize("head", [lse_torch, lse_method_keepdim, lse_mixed_dim0],
                         ids=lambda f: f.__name__)
def test_log_sum_exp_is_stable(head: Callable) -> None:
    torch.manual_seed(2)
    model = Head(head)
    x = 20.0 + 2.0 * torch.randn(8, 16)  # logits around 20: exp overflows fp16
    e = _variants(model, x)
    msg = f"max abs error vs FP32 (outputs up to {e['scale']:.3g}): {e}"
    assert not math.isfinite(e["autocast"]) and not math.isfinite(e["half"]), msg
    assert e["fxamp"] <= 1e-2 * e["scale"], msg
    _check_rewritten(model, x, "torch.logsumexp")


@pytest.mark.slow
def test_cuda_plan_lines() -> None:
    torch.manual_seed(3)
    x = torch.randn(8, 16)
    for head, op in [(softmax_shared_exp_method, "torch.softmax"),
                     (log_f_softmax, "torch.log_softmax"), (lse_torch, "torch.logsumexp")]:
        model = Head(head)
        _check_rewritten(model, x, op, target="cuda")
        text = fxamp.plan_of(fxamp.amp_rewrite(
            model, (x,), fxamp.RewriteConfig.make(target="cuda"))).to_text()
        line = next(ln for ln in text.splitlines() if ln.startswith(_final_name(model) + " "))
        log.info("cuda plan line: %s", line)
        assert op in line and " softmax " in line and "replaced by" in line, text


def test_bf16_reason_and_dim_kept() -> None:
    torch.manual_seed(4)
    model = Head(softmax_dim0)
    x = torch.randn(8, 16)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    p = fxamp.plan_of(gm).nodes["truediv"]
    assert p.rule == "softmax" and "over dim 0" in p.reason and "bf16" in p.reason, p
    assert "torch.softmax(fc_fp32, 0)" in gm.code, gm.code
    torch.testing.assert_close(gm(x), model(x), rtol=1e-2, atol=1e-2)


class Shared(nn.Module):
    """The exp also feeds another op, the sum also feeds a log: only dead nodes go."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor):
        z = self.fc(x)
        e = torch.exp(z)
        s = e.sum(-1, keepdim=True)
        return e / s, e.mean(), torch.log(s)


def test_pattern_nodes_with_other_users_are_kept() -> None:
    torch.manual_seed(5)
    model = Shared()
    x = torch.randn(4, 16)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(target="cpu"))
    plan = fxamp.plan_of(gm)
    assert plan.nodes["truediv"].op == "torch.softmax", plan.to_text()
    assert plan.nodes["log"].op == "torch.logsumexp", plan.to_text()
    assert plan.nodes["exp"].rule == "autocast", plan.to_text()  # still used by the mean
    assert "sum_1" not in plan.nodes, plan.to_text()  # dead once both users were replaced
    for out, ref in zip(gm(x), model(x)):
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


class Nested(nn.Module):
    """log(exp/sum softmax) and log(nn.Softmax): both end as one log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor):
        z = self.fc(x)
        e = z.exp()
        return torch.log(e / e.sum(-1, keepdim=True)), torch.log(self.softmax(z))


def test_nested_and_module_softmax() -> None:
    torch.manual_seed(6)
    model = Nested()
    x = 8.0 * torch.randn(4, 16)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(target="cpu"))
    plan = fxamp.plan_of(gm)
    rewritten = {n: (p.op, p.rule) for n, p in plan.nodes.items() if p.rule == "softmax"}
    assert rewritten == {"log": ("torch.log_softmax", "softmax"),
                         "log_1": ("torch.log_softmax", "softmax")}, plan.to_text()
    assert "truediv" not in plan.nodes and "softmax" not in plan.nodes, plan.to_text()
    for out, ref in zip(gm(x), model(x)):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=0.05)


# ---------------------------------------------------------------------------------------
# near misses
# ---------------------------------------------------------------------------------------
NEAR_MISSES = [miss_different_inputs, miss_no_keepdim, miss_two_dims, miss_reversed,
               miss_log_sigmoid, miss_log_mean_exp, miss_log_sum_all, miss_softmax_dtype,
               miss_rounding_div]


@pytest.mark.parametrize("head", NEAR_MISSES, ids=lambda f: f.__name__)
def test_near_misses_are_left_alone(head: Callable) -> None:
    torch.manual_seed(7)
    model = Head(head)
    x = torch.randn(16, 16)  # moderate logits: autocast's output is finite
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=FP16, target="cpu"))
    off = fxamp.amp_rewrite(model, (x,),
                            fxamp.RewriteConfig.make(dtype=FP16, target="cpu",
                                                     policy="numerics=off"))
    plan, plan_off = fxamp.plan_of(gm), fxamp.plan_of(off)
    assert list(plan.nodes) == list(plan_off.nodes), plan.to_text()
    assert all(p.rule != "softmax" for p in plan.nodes.values()), plan.to_text()
    assert [(p.op, p.rule, p.dtype) for p in plan.nodes.values()] == \
        [(p.op, p.rule, p.dtype) for p in plan_off.nodes.values()], plan.to_text()
    with torch.autocast("cpu", dtype=FP16):
        expected = model(x)
    out = gm(x)
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(off(x), expected, rtol=0, atol=0, equal_nan=True)


class Attn(nn.Module):
    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return softmax_shared_exp_method(s)


class WithSubmodule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.attn = Attn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.fc(x))


def test_pass_keeps_name_and_meta() -> None:
    from fxamp.passes.manager import PassContext
    from fxamp.passes.softmax import stable_softmax
    from fxamp.policy import Policy

    model = WithSubmodule()
    src = fxamp_trace(model)
    old = next(n for n in src.graph.nodes if n.name == "truediv")
    meta = {k: old.meta.get(k) for k in ("stack_trace", "nn_module_stack")}
    assert stable_softmax(src, PassContext(Policy())).modified
    src.graph.lint()
    new = next(n for n in src.graph.nodes if n.name == "truediv")
    assert new.target is torch.softmax and new.args[1] == -1
    assert {k: new.meta.get(k) for k in meta} == meta
    assert not stable_softmax(src, PassContext(Policy())).modified  # nothing left to rewrite
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, (torch.randn(2, 8),)))
    assert (plan.nodes["truediv"].module, plan.nodes["truediv"].rule) == ("attn", "softmax")
