"""Quickstart: rewrite a model for FP16 mixed precision, train it with GradScaler, print the plan.

Run: python examples/quickstart.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128),
    nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10),
)
example_batch = torch.randn(32, 64)

gm = fxamp.amp_rewrite(model, (example_batch,), dtype=torch.float16)   # target="cuda" lists
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the same FP32 master weights
device = "cuda" if torch.cuda.is_available() else "cpu"
gm.to(device)
scaler = torch.amp.GradScaler(device)

# data generated here: a random linear teacher
teacher = torch.randn(64, 10)
for step in range(50):
    x = torch.randn(32, 64, device=device)
    y = (x @ teacher.to(device)).argmax(-1)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(gm(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if step % 10 == 0 or step == 49:
        print(f"step {step:2d}  loss {loss.item():.3f}  scale {scaler.get_scale():.0f}")

assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
print(fxamp.plan_of(gm).to_text())   # why each node runs in FP16 or FP32
