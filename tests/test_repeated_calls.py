"""A module called several times per step (a siamese encoder, a GAN discriminator called on
real, fake and interpolated images): docs/behaviour.md, "Limits".

Autocast's weight-cast cache spans its region: every call reads one bf16 copy of a weight,
so the calls' weight gradients are summed in bf16 before the one cast back. A rewritten
module casts its weights on each call, so each call's gradient is cast to FP32 and the sum
is in FP32. The tests check that: the summed gradient equals the FP32 sum of the per-call
gradients bit for bit; it stays within the bound the page states of autocast's, relative to
the gradient's scale; and it is no farther from the FP32 model's gradient than autocast's.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn

import fxamp

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16
G = torch.Generator().manual_seed(1)
A, B = torch.randn(32, 16, generator=G), torch.randn(32, 16, generator=G)
REAL, FAKE = torch.randn(16, 3, 16, 16, generator=G), torch.randn(16, 3, 16, 16, generator=G)
EPS = torch.rand(16, 1, 1, 1, generator=G)
MID = EPS * REAL + (1 - EPS) * FAKE
#: the bounds docs/behaviour.md states: max |fxamp - autocast| over max |FP32 gradient|
BOUND = {"siamese": 1e-2, "discriminator": 1e-1}


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _discriminator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.LeakyReLU(0.2),
                         nn.Conv2d(16, 32, 3, 2, 1), nn.LeakyReLU(0.2), nn.Flatten(),
                         nn.Linear(32 * 4 * 4, 1))


def _siamese_loss(f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return (f(A).float() - f(B).float()).pow(2).sum(-1).mean()


def _critic_loss(f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return f(REAL).float().mean() - f(FAKE).float().mean() + f(MID).float().pow(2).mean()


CASES: Dict[str, Tuple[Callable[[], nn.Module], Callable, torch.Tensor]] = {
    "siamese": (_encoder, _siamese_loss, A),
    "discriminator": (_discriminator, _critic_loss, REAL),
}


def _grads(case: str, mode: str) -> Dict[str, torch.Tensor]:
    """Each parameter's gradient of the case's loss: "fp32", "autocast" or "fxamp"."""
    make, loss, example = CASES[case]
    model = make()
    run = fxamp.amp_rewrite(
        model, (example,), fxamp.RewriteConfig.make(dtype=BF16)) if mode == "fxamp" else model
    with torch.autocast("cpu", dtype=BF16, enabled=mode == "autocast"):
        value = loss(run)
    value.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_the_summed_weight_gradient_is_the_fp32_sum_of_the_per_call_gradients():
    model = _encoder()
    gm = fxamp.amp_rewrite(model, (A,), fxamp.RewriteConfig.make(dtype=BF16))
    params: List[nn.Parameter] = list(model.parameters())
    out_a, out_b = gm(A).float(), gm(B).float()
    loss = (out_a - out_b).pow(2).sum(-1).mean()
    *summed, up_a, up_b = torch.autograd.grad(loss, params + [out_a, out_b])
    per_a = torch.autograd.grad(gm(A).float(), params, up_a)  # each call alone, the same
    per_b = torch.autograd.grad(gm(B).float(), params, up_b)  # upstream gradient
    for name, total, ga, gb in zip([n for n, _ in model.named_parameters()], summed,
                                   per_a, per_b):
        assert total.dtype is torch.float32
        assert torch.equal(total, ga + gb), name


def test_repeated_calls_stay_within_the_documented_bound_of_autocast():
    for case, bound in BOUND.items():
        ref, ac, fx = _grads(case, "fp32"), _grads(case, "autocast"), _grads(case, "fxamp")
        differs = False
        for name, g32 in ref.items():
            scale = g32.abs().max().item()
            gap = (fx[name] - ac[name]).abs().max().item()
            differs |= gap > 0
            assert gap <= bound * scale, (case, name, gap / scale)
        assert differs, case  # the cast cache's bf16 sum really differs from the FP32 sum


def test_repeated_calls_are_no_farther_from_fp32_than_autocast():
    for case in CASES:
        ref, ac, fx = _grads(case, "fp32"), _grads(case, "autocast"), _grads(case, "fxamp")
        to_fp32 = {label: sum((g[n] - ref[n]).abs().max().item() for n in ref)
                   for label, g in (("autocast", ac), ("fxamp", fx))}
        assert to_fp32["fxamp"] <= to_fp32["autocast"], (case, to_fp32)
