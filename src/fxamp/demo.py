"""Built-in example models and the demo that `fxamp demo` runs."""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)


class SmallCNN(nn.Module):
    """A small conv net for 1x8x8 digits: conv, BatchNorm, pooling, a LayerNorm'd head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = x.mean(dim=(2, 3))
        return self.fc(self.norm(x))


def small_cnn() -> Tuple[nn.Module, Tuple[torch.Tensor]]:
    """Factory for ``fxamp plan fxamp.demo:small_cnn``: the model and an example batch."""
    torch.manual_seed(0)
    return SmallCNN(), (torch.randn(4, 1, 8, 8),)


def digits_like(n: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """A synthetic 8x8 ten-class problem: class templates plus noise (no downloads)."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    x = templates[y] + 0.5 * torch.randn(n, 1, 8, 8, generator=g)
    return x, y


def run_demo(steps: int = 30, dtype: torch.dtype = torch.float16,
             target: Optional[str] = None) -> Dict[str, object]:
    """Rewrite SmallCNN, train it a few steps with GradScaler, return losses and the plan.

    The model trains on CUDA when there is a GPU, else on the CPU; ``target`` (default: that
    device) is whose autocast lists the plan mirrors."""
    from . import RewriteConfig, amp_rewrite, plan_of

    model, example = small_cnn()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    gm = amp_rewrite(model, tuple(x.to(device) for x in example),
                     RewriteConfig.make(dtype=dtype, target=target))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    x, y = digits_like(512)
    x, y = x.to(device), y.to(device)
    losses = []
    for step in range(steps):
        idx = torch.arange(step * 32, step * 32 + 32) % len(x)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(gm(x[idx]).float(), y[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return {"plan": plan_of(gm), "losses": losses, "scale": float(scaler.get_scale()),
            "device": device}
