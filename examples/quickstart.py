"""Quickstart: rewrite a model for FP16 mixed precision, train it with GradScaler, print the plan.

Run: python examples/quickstart.py [--device cpu|cuda] [--dtype fp16|bf16]

The GradScaler is made for the device the model trains on: ``torch.amp.GradScaler()`` means
CUDA, and on a CPU model it warns and disables itself, so FP16 would train unscaled. FP16
needs loss scaling on every device; BF16 has FP32's range and needs none.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp


def make_scaler(device: torch.device, dtype: torch.dtype) -> torch.amp.GradScaler:
    """A GradScaler for ``device``, enabled for fp16 (bf16 needs no loss scaling)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def build(device: torch.device, dtype: torch.dtype, target: str = ""):
    """The model on ``device``, rewritten for ``dtype`` with the lists of ``target``'s
    autocast (default: ``device``'s; plan for the device you run on)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128),
        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10),
    ).to(device)
    example_batch = torch.randn(32, 64, device=device)
    gm = fxamp.amp_rewrite(model, (example_batch,),
                           fxamp.RewriteConfig.make(dtype=dtype, target=target or device.type))
    return model, gm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16

    model, gm = build(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the same FP32 master weights
    scaler = make_scaler(device, dtype)
    print(f"device {device.type}, {args.dtype}, GradScaler enabled: {scaler.is_enabled()}")

    teacher = torch.randn(64, 10, device=device)  # data generated here: a random linear teacher
    for step in range(args.steps):
        x = torch.randn(32, 64, device=device)
        y = (x @ teacher).argmax(-1)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(gm(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:2d}  loss {loss.item():.3f}  scale {scaler.get_scale():.0f}")

    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    print(fxamp.plan_of(gm).to_text())   # why each node runs in FP16 or FP32


if __name__ == "__main__":
    main()
