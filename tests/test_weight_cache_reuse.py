"""weights=o2's weight copies re-cast into their old memory, and the FP32 gradient memory of
large CPU weights kept between steps (fxamp/weight_cache.py): numbers bit-identical to
casting every forward (``weights=cast``, the default: plain ``Tensor.to`` in the graph),
memory actually reused, and never a tensor someone still holds overwritten. Without an
attached optimizer every o2 forward with grad casts into the old memory; with one, the
step re-casts there."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.weight_cache import BIG, caches

BF16 = torch.bfloat16
VOCAB, D = 4096, 64  # the tied embedding/head is 1 MiB in FP32: the _CastBack path


class TinyDecoder(nn.Module):
    """Token + position embeddings, one pre-norm attention block, tied head (GPT-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(16, D)
        self.ln1, self.ln2, self.ln = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (z.reshape(b, t, 4, D // 4).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        x = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return F.linear(self.ln(x), self.wte.weight)


def _pair(policy: str):
    torch.manual_seed(0)
    a = TinyDecoder()
    b = copy.deepcopy(a)
    x = torch.randint(0, VOCAB, (2, 8))
    ga = fxamp.amp_rewrite(
        a, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="weights=cast"))
    gb = fxamp.amp_rewrite(b, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy=policy))
    return a, ga, b, gb


def _batch():
    return torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (16,))


@pytest.mark.slow
@pytest.mark.parametrize("attach", [False, True], ids=["o2_forward_casts", "o2_attached"])
def test_training_bit_identical_to_casting_every_forward_and_memory_reused(attach):
    a, ga, b, gb = _pair("weights=o2")
    assert b.wte.weight.numel() * 4 >= BIG > b.qkv.weight.numel() * 4  # both paths
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    if attach:
        fxamp.train.attach_optimizer(gb, opts[1])
    cache = caches(gb)[0]
    head = next(s for s in cache.slots if s.param is b.wte.weight)
    qkv = next(s for s in cache.slots if s.param is b.qkv.weight)
    torch.manual_seed(1)
    ptrs = []
    for step in range(4):
        for micro in range(2):  # gradient accumulation: .grad kept between micro-batches
            idx, y = _batch()
            losses = [F.cross_entropy(g(idx).reshape(-1, VOCAB), y) for g in (ga, gb)]
            assert torch.equal(losses[0], losses[1]), (step, micro)
            for loss in losses:
                loss.backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert pb.grad.dtype == torch.float32 and torch.equal(pa.grad, pb.grad), step
        ptrs.append((head.copy.data_ptr(), qkv.copy.data_ptr(), head.grad_buf.data_ptr()))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), step
    # the copies are re-cast into the same memory every step; the large weight's FP32
    # gradient is cast into the same memory too (between micro-batches .grad holds it and
    # the next micro-batch's cast is a temporary added into it)
    assert len(set(p[0] for p in ptrs[1:])) == 1 and len(set(p[1] for p in ptrs[1:])) == 1
    assert len(set(p[2] for p in ptrs[1:])) == 1
    assert fxamp.weight_cache_bytes(gb) > b.wte.weight.numel() * 2  # grad memory counted
    with torch.no_grad():
        assert torch.equal(gb(idx), ga(idx))


@pytest.mark.slow
def test_tied_weight_gradient_is_summed_in_place_into_the_kept_memory():
    """The head's cast gradient is handed to autograd as a tensor nobody else holds, so the
    embedding's gradient is added into it in place (as for autocast's fresh cast) and it
    becomes .grad: no out-of-place sum of the tied weight, no fresh memory per step."""
    from torch.profiler import profile

    a, ga, b, gb = _pair("weights=o2")
    head = next(s for s in caches(gb)[0].slots if s.param is b.wte.weight)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (a, b)]
    fxamp.train.attach_optimizer(gb, opts[1])
    torch.manual_seed(3)
    ptrs = []
    for step in range(3):
        idx, y = _batch()
        losses = [F.cross_entropy(g(idx).reshape(-1, VOCAB), y) for g in (ga, gb)]
        losses[0].backward()
        with profile(record_shapes=True) as prof:
            losses[1].backward()
        sums = [e for e in prof.events() if e.name == "aten::add"
                and list(VOCAB_D) in [list(s) for s in e.input_shapes]]
        assert sums == [], step  # before: one out-of-place aten::add of the tied weight
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad), step
        ptrs.append((b.wte.weight.grad.data_ptr(), head.grad_buf.data_ptr()))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(g == k for g, k in ptrs) and len(set(ptrs[1:])) == 1, ptrs


VOCAB_D = (VOCAB, D)


@pytest.mark.slow
@pytest.mark.parametrize("hold", ["grad", "grad.detach()", "grad.data"])
def test_a_copy_or_gradient_someone_holds_is_never_overwritten(hold):
    a, ga, b, gb = _pair("weights=o2")
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (a, b)]
    fxamp.train.attach_optimizer(gb, opts[1])
    torch.manual_seed(2)
    idx, y = _batch()
    for g in (ga, gb):  # a first step: the copies and gradient memory exist
        F.cross_entropy(g(idx).reshape(-1, VOCAB), y).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    idx, y = _batch()
    # 1. a graph still alive (backward later) keeps the copies it saved
    kept = [F.cross_entropy(g(idx).reshape(-1, VOCAB), y) for g in (ga, gb)]
    with torch.no_grad():  # change the cast weights (the graphs saved only their copies)
        for m in (a, b):
            for p in (m.wte.weight, m.qkv.weight, m.fc.weight, m.out.bias):
                p.add_(0.25)
    idx2, y2 = _batch()
    for g in (ga, gb):  # the weights changed: this forward re-casts them
        F.cross_entropy(g(idx2).reshape(-1, VOCAB), y2).backward()
    # 2. a caller keeps a gradient: the tensor, or an alias of its memory that no use
    # count of that tensor shows
    held = [{"grad": lambda g: g, "grad.detach()": lambda g: g.detach(),
             "grad.data": lambda g: g.data}[hold](m.wte.weight.grad) for m in (a, b)]
    held_values = [h.clone() for h in held]
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    for loss in kept:  # the first graph's backward, with the weights it saw
        loss.backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)
    for h, v in zip(held, held_values):
        assert torch.equal(h, v)
    assert held[1].data_ptr() != b.wte.weight.grad.data_ptr()


@pytest.mark.slow
def test_no_reference_cycle_keeps_a_dropped_model_alive():
    import gc
    import weakref
    _, _, b, gb = _pair("weights=o2")  # (no optimizer attached: its hook would hold gm)
    idx, y = _batch()
    F.cross_entropy(gb(idx).reshape(-1, VOCAB), y).backward()
    ref = weakref.ref(caches(gb)[0])
    del gb
    gc.collect()
    assert ref() is None
