"""A training loop that computes its loss under ``torch.autocast`` (timm's ``train.py``, the
torchvision references): docs/training.md, "When your loop computes the loss under autocast".

The pattern the page shows — the loop's autocast left on, the model rewritten with
``policy="output=keep"`` — gives the loop's autocast the model's bf16 logits, as plain
autocast does, so the loss, the logits and every gradient are autocast's bit for bit over
two optimizer steps (timm ``resnet10t`` and ``test_vit``, random weights, CPU bf16).
Without it the model returns FP32 logits and a loss that computes in the low dtype under
autocast (timm's label-smoothing cross-entropy: ``log_softmax``, ``gather``, ``mean`` in
bf16) runs in FP32 instead, which the last test shows.
"""
from __future__ import annotations

import copy
from typing import Callable, List, Tuple

import pytest
import timm
import torch
import torch.nn as nn
from timm.loss import LabelSmoothingCrossEntropy

import fxamp

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16
X = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
X_VIT = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 3, 9, 1])
LOSSES = {"CrossEntropyLoss": nn.CrossEntropyLoss,
          "LabelSmoothingCrossEntropy": lambda: LabelSmoothingCrossEntropy(0.1)}


def _model(name: str = "resnet10t") -> nn.Module:
    torch.manual_seed(0)
    if name == "test_vit":  # (layer_norm and softmax: on CUDA's fp32 list, not on CPU's)
        return timm.create_model(name, pretrained=False, num_classes=10, img_size=32)
    return timm.create_model(name, pretrained=False, num_classes=10)


def _train(model: nn.Module, run: nn.Module, criterion: nn.Module, steps: int = 2,
           x: torch.Tensor = X) -> List[Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]]:
    """The loop under test: forward and loss under autocast, backward and SGD outside."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            logits = run(x)
            loss = criterion(logits, Y)
        loss.backward()
        seen.append((logits.detach(), loss.detach(),
                     [p.grad.clone() for p in model.parameters()]))
        optimizer.step()
    return seen


@pytest.mark.parametrize("name,loss", [("resnet10t", "CrossEntropyLoss"),
                                       ("resnet10t", "LabelSmoothingCrossEntropy"),
                                       ("test_vit", "LabelSmoothingCrossEntropy")])
def test_output_keep_under_the_loops_autocast_equals_autocast_bit_for_bit(name: str,
                                                                          loss: str):
    criterion: Callable[[], nn.Module] = LOSSES[loss]
    x = X_VIT if name == "test_vit" else X
    reference = _model(name)
    model = copy.deepcopy(reference)
    # as the page shows
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, policy="output=keep"))
    want = _train(reference, reference, criterion(), x=x)
    got = _train(model, gm, criterion(), x=x)
    for (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) in zip(want, got):
        assert logits_b.dtype is BF16 and torch.equal(logits_a, logits_b)
        assert torch.equal(loss_a, loss_b)
        assert len(grads_a) == len(grads_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_fp32_logits_make_a_low_precision_loss_run_in_fp32_instead():
    reference = _model()
    model = copy.deepcopy(reference)
    gm = fxamp.amp_rewrite(
        model, (X,), fxamp.RewriteConfig.make(dtype=BF16))  # the default: FP32 outputs
    want = _train(reference, reference, LabelSmoothingCrossEntropy(0.1), steps=1)
    got = _train(model, gm, LabelSmoothingCrossEntropy(0.1), steps=1)
    (logits_a, loss_a, _), (logits_b, loss_b, _) = want[0], got[0]
    assert logits_b.dtype is torch.float32 and torch.equal(logits_a.float(), logits_b)
    assert loss_a.dtype is BF16 and not torch.equal(loss_a.float(), loss_b)
