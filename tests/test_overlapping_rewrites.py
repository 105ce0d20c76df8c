"""Overlapping in-place rewrites (``rewriter/overlap.py``): a block rewritten in place and the
model around it rewritten in place too, in either order, with example inputs and without
(first-call planning, block mode), with the fx and export front ends. Of one policy they
compose: the model computes exactly like the FP32 model under torch.autocast. Of different
policies (a block in fp16 inside a model in bf16) they are refused with
``OverlappingRewriteError`` naming the earlier rewrite, and the model computes as before;
each advice of the error, followed, gives what it says."""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

BF16, FP16 = torch.bfloat16, torch.float16
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
H = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.ln(self.fc(x)))


class Net(nn.Module):
    """Two blocks in a ModuleList: block mode applies without example inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _autocast(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return module(x).float()


def _eval(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(x).float()


def _rewrites(model: Net, example: bool, frontend: str, inner: torch.dtype,
              outer: torch.dtype):
    """The block's and the model's in-place rewrites, as callables."""
    def block():
        return fxamp.amp_rewrite(model.blocks[0], (H,) if example else None,
                                 fxamp.RewriteConfig.make(dtype=inner, target="cpu",
                                                          frontend=frontend), inplace=True)

    def root():
        return fxamp.amp_rewrite(model, (X,) if example else None,
                                 fxamp.RewriteConfig.make(dtype=outer, target="cpu",
                                                          frontend=frontend), inplace=True)

    return block, root


def _first(model: Net, rewrite) -> None:
    """The first rewrite, and a call (planning it when it had no example)."""
    rewrite()
    _eval(model, X)


CASES = [(order, example, frontend) for order in ("block_first", "model_first")
         for example in (True, False) for frontend in ("fx", "export")]
IDS = [f"{o}-{'example' if e else 'first_call'}-{f}" for o, e, f in CASES]


@pytest.mark.parametrize("order,example,frontend", CASES, ids=IDS)
def test_overlapping_in_place_rewrites_of_one_policy_equal_autocast(order, example, frontend):
    ref, model = _net(), _net()
    block, root = _rewrites(model, example, frontend, BF16, BF16)
    first, second = (block, root) if order == "block_first" else (root, block)
    _first(model, first)
    second()
    assert torch.equal(_eval(model, X), _autocast(ref, X, BF16))
    if example:  # (in block mode a block's graph takes what the glue gives it: bf16)
        assert torch.equal(_eval(model.blocks[0], H), _autocast(ref.blocks[0], H, BF16))


@pytest.mark.parametrize("order,example,frontend", CASES, ids=IDS)
@pytest.mark.parametrize("inner,outer", [(FP16, BF16), (BF16, FP16)], ids=["fp16_in_bf16",
                                                                           "bf16_in_fp16"])
def test_overlapping_in_place_rewrites_of_different_dtypes_are_refused_naming_the_first(
        order, example, frontend, inner, outer):
    ref, model = _net(), _net()
    block, root = _rewrites(model, example, frontend, inner, outer)
    first, second = (block, root) if order == "block_first" else (root, block)
    _first(model, first)
    before = _eval(model, X)
    with pytest.raises(fxamp.OverlappingRewriteError) as err:
        second()
    text = str(err.value)
    earlier = (f"{'fp16' if inner == FP16 else 'bf16'}" if order == "block_first"
               else f"{'fp16' if outer == FP16 else 'bf16'}")
    assert "blocks.0" in text and "rewritten in place before with policy" in text
    assert f"compute={earlier},target=cpu" in text and "what to do" in text
    assert isinstance(err.value, fxamp.UnsupportedModelError)
    assert torch.equal(_eval(model, X), before)  # (the earlier rewrite is left as it was)
    if order == "model_first":  # the model computes with its own policy, as before
        assert torch.equal(before, _autocast(ref, X, outer))


def test_a_returned_rewrite_of_a_model_with_a_part_in_place_of_another_dtype_is_refused():
    model = _net()
    fxamp.amp_rewrite(model.blocks[0], (H,), fxamp.RewriteConfig.make(dtype=FP16, target="cpu"),
                      inplace=True)
    with pytest.raises(fxamp.OverlappingRewriteError, match="inplace=False"):
        fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))


def _advice(text: str) -> list:
    return re.findall(r"amp_rewrite\(([\w.\[\]]+), \.\.\., '([^']+)'", text)


@pytest.mark.parametrize("example", [True, False], ids=["example", "first_call"])
def test_following_the_advice_for_a_block_rewritten_first_gives_one_plan(example):
    ref = _net()
    for which in (0, 1):
        model = _net()
        block, root = _rewrites(model, example, "fx", FP16, BF16)
        _first(model, block)
        with pytest.raises(fxamp.OverlappingRewriteError) as err:
            root()
        advice = _advice(str(err.value))
        assert [a for a, _ in advice] == ["model", "model.blocks[0]"]
        target, policy = advice[which]
        if which == 1:  # the block's rewrite replaced by one of the model's policy, then it
            fxamp.amp_rewrite(model.blocks[0], (H,) if example else None, policy, inplace=True)
            assert torch.equal(_eval(model.blocks[0], H), _autocast(ref.blocks[0], H, BF16))
        fxamp.amp_rewrite(model, (X,) if example else None, advice[0][1] if which == 0
                          else policy, inplace=True)
        want = FP16 if which == 0 else BF16
        assert torch.equal(_eval(model, X), _autocast(ref, X, want)), which


@pytest.mark.parametrize("example", [True, False], ids=["example", "first_call"])
def test_following_the_advice_for_a_model_rewritten_first_gives_what_it_says(example):
    ref = _net()
    model = _net()
    block, root = _rewrites(model, example, "fx", FP16, BF16)
    _first(model, root)
    with pytest.raises(fxamp.OverlappingRewriteError) as err:
        block()
    text = str(err.value)
    assert "rewrite blocks.0 with inplace=False" in text
    # a returned module of the block: its own plan, the model's left as it is
    fast = fxamp.amp_rewrite(model.blocks[0], (H,),
                             fxamp.RewriteConfig.make(dtype=FP16, target="cpu"))
    assert torch.equal(_eval(fast, H), _autocast(ref.blocks[0], H, FP16))
    assert torch.equal(_eval(model, X), _autocast(ref, X, BF16))
    # or the model itself rewritten in place with the block's policy
    [(target, policy)] = _advice(text)
    assert target == "model" and policy == "compute=fp16,target=cpu"
    fxamp.amp_rewrite(model, (X,) if example else None, policy, inplace=True)
    assert torch.equal(_eval(model, X), _autocast(ref, X, FP16))
    block()  # (now of one policy: it composes)
    assert torch.equal(_eval(model, X), _autocast(ref, X, FP16))


_THREADS: list = []


class _Probe(Block):
    """A block whose forward, while the model around it is traced by torch.fx, starts
    another thread calling this block (``self.call``) and gives it time to reach the call."""

    call = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.fx.Proxy) and self.call is not None:
            thread = threading.Thread(target=self.call)
            thread.start()
            _THREADS.append(thread)  # (not on the module: its state is put back)
            time.sleep(0.3)
        return super().forward(x)


def test_another_thread_calling_a_part_while_the_model_is_traced_gets_the_part_s_rewrite():
    ref, model = _net(), _net()
    probe = _Probe()
    probe.load_state_dict(model.blocks[0].state_dict())
    model.blocks[0] = probe
    fxamp.amp_rewrite(probe, (H,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    got = []
    _THREADS.clear()
    probe.call = lambda: got.append(_eval(probe, H))
    fxamp.amp_rewrite(model, (X,),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend="fx"),
                      inplace=True)
    probe.call = None
    for thread in _THREADS:
        thread.join()
    assert len(got) == len(_THREADS) >= 1
    want = _autocast(ref.blocks[0], H, BF16)
    assert all(torch.equal(g, want) for g in got)  # (not the block's FP32 forward)
    assert torch.equal(_eval(model, X), _autocast(ref, X, BF16))
