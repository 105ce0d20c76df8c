"""``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` in eval under ``no_grad``:
docs/behaviour.md, "Limits".

PyTorch's fast-path guard asks ``torch.is_autocast_enabled()`` without a device, which is
False inside ``torch.autocast("cpu")``, so the layer runs its fused kernel there in eval under
``no_grad``; a rewritten graph computes the regular path, which autocast takes with grad and
in training. The plan header names such modules (``fast_path``), the eval outputs differ
from autocast's by at most the documented bound, and they equal autocast's bit for bit with
grad enabled and with ``torch.backends.mha.set_fastpath_enabled(False)``. A
``MultiheadAttention`` that fx keeps as a call runs under autocast, fast path and all, and is
equal to it.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
import torch.nn as nn

import fxamp

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16
#: the bound docs/behaviour.md states for the eval outputs' max abs difference
BOUND = 5e-2


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attn(x, x, x, need_weights=False)[0])


def _input(seed: int) -> torch.Tensor:
    return torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def _fastpath(enabled: bool) -> Iterator[None]:
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


def _autocast(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16):
        return model(x)


def test_the_plan_header_names_the_layers_that_take_the_fast_path():
    gm = fxamp.amp_rewrite(_encoder(), (_input(0),), fxamp.RewriteConfig.make(dtype=BF16))
    note = fxamp.plan_of(gm).header["fast_path"]
    assert note.startswith("layers.0=TransformerEncoderLayer layers.1=TransformerEncoderLayer:")
    assert "set_fastpath_enabled(False)" in note
    assert fxamp.Plan.from_text(fxamp.plan_of(gm).to_text()).header["fast_path"] == note
    # inside torch.autocast("cuda") the guard sees autocast and takes the regular path
    cuda = fxamp.amp_rewrite(_encoder(), (_input(0),),
                             fxamp.RewriteConfig.make(dtype=BF16, target="cuda"))
    assert "fast_path" not in fxamp.plan_of(cuda).header


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_encoder_eval_under_no_grad_is_within_the_documented_bound_of_autocast(seed: int):
    model, x = _encoder(), _input(seed)
    gm = fxamp.amp_rewrite(copy.deepcopy(model), (x,), fxamp.RewriteConfig.make(dtype=BF16))
    with torch.no_grad():
        want, got = _autocast(model, x), gm(x)
    diff = (want.float() - got).abs().max().item()
    assert 0 < diff <= BOUND  # the fused kernel rounds otherwise; the bound holds


def test_encoder_eval_equals_autocast_with_grad_and_without_the_fast_path():
    model, x = _encoder(), _input(0)
    gm = fxamp.amp_rewrite(copy.deepcopy(model), (x,), fxamp.RewriteConfig.make(dtype=BF16))
    assert torch.equal(_autocast(model, x), gm(x))  # with grad: the regular path
    with torch.no_grad(), _fastpath(False):
        assert torch.equal(_autocast(model, x), gm(x))


def test_a_multihead_attention_kept_as_a_call_equals_autocast_in_eval():
    torch.manual_seed(0)
    model, x = SelfAttention().eval(), _input(0)
    gm = fxamp.amp_rewrite(copy.deepcopy(model), (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, policy="output=keep"))
    assert "fast_path" not in fxamp.plan_of(gm).header
    with torch.no_grad():
        assert torch.equal(_autocast(model, x), gm(x))


def _in_place(model: nn.Module, timing: str, policy: str) -> nn.Module:
    config = fxamp.RewriteConfig.make(dtype=BF16, policy=policy)
    example = (_input(0),) if timing == "example" else None
    fxamp.amp_rewrite(model, example, config, inplace=True)
    return model


@pytest.mark.parametrize("timing", ["example", "first call"])
def test_a_model_rewritten_in_place_equals_autocast_in_eval_without_grad(timing):
    """The fused fast path is what autocast runs there: the call runs under autocast, bit
    for bit, the first call in eval included; an override shows that with the fast path
    off (or with grad) the plan computes."""
    ref = _encoder()
    model = _in_place(copy.deepcopy(ref), timing, "fp32:aten.linear")
    for seed in (0, 1):
        x = _input(seed)
        with torch.no_grad():
            want, got = _autocast(ref, x), model(x)
        assert torch.equal(want.float(), got), seed
    x = _input(2)
    with torch.no_grad(), _fastpath(False):
        assert not torch.equal(_autocast(ref, x).float(), model(x))  # (the plan: FP32 linears)
    assert not torch.equal(_autocast(ref, x).float(), model(x))  # (with grad: the plan)


def test_a_transformer_kept_as_one_call_gets_no_note():
    """fx keeps torch.nn's modules as calls, which run under autocast, fast path and all:
    no note for the layers inside such a call (the note named them before)."""
    model = nn.Sequential(nn.Linear(32, 32), _encoder())
    gm = fxamp.amp_rewrite(copy.deepcopy(model), (_input(0),),
                           fxamp.RewriteConfig.make(dtype=BF16, frontend="fx"))
    plan = fxamp.plan_of(gm)
    assert plan.nodes["_1"].rule == "runtime"
    assert "fast_path" not in plan.header
