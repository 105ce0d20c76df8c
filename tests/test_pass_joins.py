"""The joins pass (rule "joins"): cat / stack / where / index_put of mixed dtypes get one
dtype, the widest.

Where the plan would leave a join with mixed inputs (no autocast list) or where autocast's own
promotion raises, the join gets rule "joins" and its inputs are cast to the widest dtype;
joins autocast already promotes to one dtype, and joins of one dtype, keep rule "autocast".
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import ir

log = logging.getLogger(__name__)

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


class ConvAndUpsample(nn.Module):
    """A conv branch (FP16 on both lists) and a bilinear upsample branch (FP32 on CUDA's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
        up = F.interpolate(small, scale_factor=2.0, mode="bilinear", align_corners=False)
        return torch.cat([self.conv(x), up], 1)


def _inputs() -> tuple:
    torch.manual_seed(0)
    return torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4)


def test_cuda_conv_and_interpolate_meet_in_cat() -> None:
    model, inputs = ConvAndUpsample(), _inputs()
    gm = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(dtype=FP16, target="cuda"))
    plan = fxamp.plan_of(gm)
    assert (plan.nodes["conv"].dtype, plan.nodes["interpolate"].dtype) == (FP16, FP32)
    cat = plan.nodes["cat"]
    log.info("cat: %s", cat)
    assert (cat.rule, cat.inputs, cat.dtype) == ("joins", FP32, FP32), plan.to_text()
    assert cat.reason == "joins fp16 (conv) and fp32 (interpolate) inputs: promoted to fp32"
    # the rewritten graph casts the conv branch up before the cat, and runs (here on CPU)
    assert "conv_fp32" in gm.code, gm.code
    keep = fxamp.amp_rewrite(model, inputs,
                             fxamp.RewriteConfig.make(dtype=FP16, target="cuda",
                                                      policy="output=keep"))
    out = keep(*inputs)
    assert out.dtype == FP32
    ref = model(*inputs)
    err = (out - ref).abs().max().item()
    log.info("cuda-target rewrite run on CPU: max abs error vs FP32 %.3g", err)
    assert err < 1e-2, f"max abs error vs FP32 {err:.3g}"
    # numerics off: what autocast does, the cat on no list and left to torch's promotion
    off = fxamp.plan_of(fxamp.amp_rewrite(model, inputs,
                                          fxamp.RewriteConfig.make(target="cuda",
                                                                   policy="numerics=off")))
    assert (off.nodes["cat"].rule, off.nodes["cat"].inputs) == ("autocast", None)


def test_cpu_cat_autocast_already_promotes() -> None:
    """CPU cat is on autocast's promote list: the plan already casts both inputs to fp32."""
    model, inputs = ConvAndUpsample(), _inputs()
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, inputs,
                                           fxamp.RewriteConfig.make(dtype=FP16, target="cpu")))
    cat = plan.nodes["cat"]
    assert (cat.rule, cat.inputs, cat.dtype) == ("autocast", FP32, FP32), plan.to_text()


class HalfAndBfloat(nn.Module):
    """One branch cast to bf16 by hand, the other FP16 under autocast."""

    def __init__(self, join: str = "cat", both_bf16: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.join, self.both_bf16 = join, both_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.fc1(x)
        if self.both_bf16:
            a = a.to(torch.bfloat16)
        b = self.fc2(x).to(torch.bfloat16)
        if self.join == "stack":
            return torch.stack([a, b])
        return torch.cat([a, b], -1)


@pytest.mark.parametrize("join", ["cat", "stack"])
def test_cpu_fp16_and_bf16_join(join: str) -> None:
    torch.manual_seed(1)
    model, x = HalfAndBfloat(join), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="prioritize"):
        with torch.autocast("cpu", dtype=FP16):
            model(x)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=FP16, target="cpu"))
    node = fxamp.plan_of(gm).nodes[join]
    log.info("%s: %s", join, node)
    assert (node.rule, node.inputs, node.dtype) == ("joins", FP32, FP32), node
    assert node.reason == ("joins fp16 (fc1) and bf16 (to) inputs: promoted to fp32 "
                           "(torch.autocast for cpu in fp16 raises on these dtypes)")
    out, ref = gm(x), model(x)
    err = (out - ref).abs().max().item()
    log.info("%s fp16+bf16: max abs error vs FP32 %.3g (plain CPU autocast raises)", join, err)
    assert err < 0.05, f"max abs error vs FP32 {err:.3g} (plain CPU autocast raises)"


def test_cpu_bf16_only_join_under_fp16() -> None:
    """Autocast's promote starts from its fp16: two bf16 inputs alone make it raise too."""
    torch.manual_seed(2)
    model, x = HalfAndBfloat(both_bf16=True), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="prioritize"):
        with torch.autocast("cpu", dtype=FP16):
            model(x)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=FP16, target="cpu"))
    cat = fxamp.plan_of(gm).nodes["cat"]
    assert (cat.rule, cat.inputs, cat.dtype) == ("joins", BF16, BF16), cat
    assert "kept in bf16" in cat.reason, cat.reason
    assert gm(x).shape == (4, 16)


class Scatter(nn.Module):
    """FP16 values written into an FP32 buffer: index_put wants one dtype."""

    def __init__(self, method: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.method = method

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        buf = x.new_zeros((6, 8))
        if self.method:
            return buf.index_put((idx,), self.fc(x))
        return torch.index_put(buf, (idx,), self.fc(x))


@pytest.mark.parametrize("method", [True, False], ids=["Tensor.index_put", "torch.index_put"])
def test_cpu_index_put_mixed(method: bool) -> None:
    torch.manual_seed(3)
    model, x, idx = Scatter(method), torch.randn(4, 8), torch.tensor([0, 2, 3, 5])
    with pytest.raises(RuntimeError, match="Index put requires"):
        with torch.autocast("cpu", dtype=FP16):
            model(x, idx)
    gm = fxamp.amp_rewrite(model, (x, idx), fxamp.RewriteConfig.make(dtype=FP16, target="cpu"))
    node = fxamp.plan_of(gm).nodes["index_put"]
    assert (node.rule, node.inputs, node.dtype) == ("joins", FP32, FP32), node
    assert node.reason == ("joins fp32 (new_zeros) and fp16 (fc) inputs: promoted to fp32 "
                           "(index_put requires one dtype)")
    out, ref = gm(x, idx), model(x, idx)
    err = (out - ref).abs().max().item()
    log.info("index_put: max abs error vs FP32 %.3g (plain CPU autocast raises)", err)
    assert err < 1e-2, f"max abs error vs FP32 {err:.3g} (plain CPU autocast raises)"


@pytest.mark.parametrize("case", ["cuda cat", "cpu index_put"])
def test_export_front_end_joins_like_fx(case: str) -> None:
    """torch.export spells the joins ``aten.cat.default`` / ``aten.index_put.default``: they
    get the same decision as the fx spellings (before, the cat was left to torch's promotion
    with rule "autocast" and the index_put rewrite failed to run)."""
    if case == "cuda cat":
        model, inputs, target, name = ConvAndUpsample(), _inputs(), "cuda", "cat"
    else:
        model, target, name = Scatter(), "cpu", "index_put"
        inputs = (torch.randn(4, 8), torch.tensor([0, 2, 3, 5]))
    decided = {}
    for frontend in ("fx", "export"):
        gm = fxamp.amp_rewrite(model, inputs,
                               fxamp.RewriteConfig.make(dtype=FP16, target=target,
                                                        frontend=frontend,
                                                        policy="output=keep"))
        node = fxamp.plan_of(gm).nodes[name]
        decided[frontend] = (node.rule, node.inputs, node.dtype)
        assert node.op.startswith("aten." if frontend == "export" else ("torch.", "Tensor."))
        err = (gm(*inputs) - model(*inputs)).abs().max().item()
        assert err < 1e-2, f"{frontend}: max abs error vs FP32 {err:.3g}"
    assert decided["export"] == decided["fx"] == ("joins", FP32, FP32), decided


def test_cuda_index_put_is_an_autocast_promote_op() -> None:
    model, x, idx = Scatter(), torch.randn(4, 8), torch.tensor([0, 2, 3, 5])
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, (x, idx),
                                           fxamp.RewriteConfig.make(dtype=FP16, target="cuda")))
    node = plan.nodes["index_put"]
    assert (node.rule, node.inputs, node.dtype) == ("autocast", FP32, FP32), plan.to_text()


class Select(nn.Module):
    """torch.where and Tensor.where between an FP16 linear and the FP32 input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = self.fc(x)
        return torch.where(x > 0, h, x), h.where(x < 0, x), torch.where(x > 0, h, 0.0)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_where_mixed(target: str) -> None:
    torch.manual_seed(4)
    model, x = Select(), torch.randn(4, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=FP16, target=target))
    plan = fxamp.plan_of(gm)
    for name in ("where", "where_1"):
        node = plan.nodes[name]
        assert (node.rule, node.inputs, node.dtype) == ("joins", FP32, FP32), plan.to_text()
        assert node.reason == "joins fp16 (fc) and fp32 (x) inputs: promoted to fp32", \
            node.reason  # in argument order; the bool condition is no floating input
    # one floating input (the other a Python float): no join to make consistent
    assert plan.nodes["where_2"].rule == "autocast", plan.to_text()
    if target == "cpu":  # torch.where promotes natively: exactly autocast's result
        with torch.autocast("cpu", dtype=FP16):
            expected = model(x)
        for out, exp in zip(gm(x), expected):
            torch.testing.assert_close(out, exp.float(), rtol=0, atol=0)


class SameDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        a, b = self.fc1(x), self.fc2(x)
        return torch.cat([a, b], -1), torch.stack((a, b)), torch.where(a > 0, a, b)


@pytest.mark.parametrize("target,dtype", [("cpu", FP16), ("cpu", BF16), ("cuda", FP16)])
def test_same_dtype_joins_untouched(target: str, dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    model, x = SameDtype(), torch.randn(4, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=dtype, target=target))
    plan = fxamp.plan_of(gm)
    for name in ("cat", "stack", "where"):
        assert plan.nodes[name].rule == "autocast", plan.to_text()
    off = fxamp.plan_of(fxamp.amp_rewrite(model, (x,),
                                          fxamp.RewriteConfig.make(dtype=dtype, target=target,
                                                                   policy="numerics=off")))
    assert [(p.rule, p.inputs, p.dtype) for p in plan.nodes.values()] == \
        [(p.rule, p.inputs, p.dtype) for p in off.nodes.values()]
    if target == "cpu":
        with torch.autocast("cpu", dtype=dtype):
            expected = model(x)
        for out, exp in zip(gm(x), expected):
            torch.testing.assert_close(out, exp.float(), rtol=0, atol=0)


def test_user_override_wins() -> None:
    model, inputs = ConvAndUpsample(), _inputs()
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(target="cuda", policy="fp16:cat"))
    cat = fxamp.plan_of(gm).nodes["cat"]
    assert (cat.rule, cat.inputs) == ("user", FP16)
    assert ir.fixed(gm.graph.find_nodes(op="call_function", target=torch.cat)[0]) is None
