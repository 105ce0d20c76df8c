"""accelerate: an in-place rewritten model prepared by ``Accelerator(mixed_precision="bf16")``
trains exactly like the same model with ``mixed_precision="no"`` (the plan is authoritative
inside accelerate's autocast) and like accelerate's bf16 on the original model."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

accelerate = pytest.importorskip("accelerate")

BF16 = torch.bfloat16
pytestmark = pytest.mark.slow
X = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 2, 1, 0, 1, 1, 2, 0])


def _run(model: nn.Module, precision: str):
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)  # one precision per Accelerator state
    GradientState._reset_state()
    acc = accelerate.Accelerator(mixed_precision=precision, cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=4)
    model, opt, data = acc.prepare(model, opt, data)
    losses = []
    for _ in range(2):
        for x, y in data:
            opt.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            acc.backward(loss)
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def test_accelerate_bf16_keeps_the_plan_s_fp32_override():
    runs = {}
    for precision in ("bf16", "no"):
        model = _mlp()
        fxamp.amp_rewrite(model, (X,),
                          fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:3"),
                          inplace=True)
        runs[precision] = _run(model, precision)
    assert runs["bf16"][0] == runs["no"][0]
    assert all(torch.equal(p, q) for p, q in zip(runs["bf16"][1], runs["no"][1]))
    assert runs["bf16"][0] != _run(_mlp(), "bf16")[0]  # the override matters


def test_accelerate_bf16_on_the_rewritten_model_equals_it_on_the_original():
    model = _mlp()
    fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    (losses, params), (ref_losses, ref_params) = _run(model, "bf16"), _run(_mlp(), "bf16")
    assert ref_losses[-1] < ref_losses[0]
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
