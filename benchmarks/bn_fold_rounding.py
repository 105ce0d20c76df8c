"""What a BatchNorm fold's FP16 weights depend on: which weight it folds and which sqrt.

The ONNX stage folds each inference BatchNorm into the Conv before it from the FP32 weight
and running statistics, in numpy, and rounds the result to FP16 once
(``src/fxamp/export/fold.py``; ``docs/architecture.md``, "Where each weight is rounded").
For torchvision models with random weights and random running statistics this prints, per
model, how many folded Conv weights (of all of them) come out different in FP16:

- folding the FP16-rounded weight (the weight the dynamo exporter is given, or the one the
  TorchScript exporter's constant folding writes) instead of the FP32 one: rounded twice;
- the same fold computed with torch's ops (vectorised CPU ``sqrt``) instead of numpy's, and
  how many BatchNorm scales differ already in FP32.

    python benchmarks/bn_fold_rounding.py [--models resnet18 resnet50] [--docs]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Tuple

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_docs, machine  # noqa: E402


def conv_bn_pairs(model: nn.Module) -> List[Tuple[nn.Conv2d, nn.BatchNorm2d]]:
    """Each Conv2d whose next module (in registration order) is a BatchNorm2d."""
    modules = list(model.modules())
    return [(a, b) for a, b in zip(modules, modules[1:])
            if isinstance(a, nn.Conv2d) and isinstance(b, nn.BatchNorm2d)]


def measure(name: str) -> List[str]:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    pairs = conv_bn_pairs(model)
    total = twice = in_torch = scales = 0
    with torch.no_grad():
        for conv, bn in pairs:
            w = conv.weight.numpy()
            scale = bn.weight.numpy() / np.sqrt(bn.running_var.numpy() + np.float32(bn.eps))
            once = (w * scale.reshape(-1, 1, 1, 1)).astype(np.float16)
            w16 = w.astype(np.float16).astype(np.float32)
            folded16 = (w16 * scale.reshape(-1, 1, 1, 1)).astype(np.float16)
            t_scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            t_once = (conv.weight * t_scale.reshape(-1, 1, 1, 1)).half().numpy()
            total += w.size
            twice += int((once != folded16).sum())
            in_torch += int((once != t_once).sum())
            scales += int((scale != t_scale.numpy()).sum())
    return [name, str(len(pairs)), f"{total:,}", f"{twice:,} ({100 * twice / total:.1f}%)",
            f"{in_torch:,}", str(scales)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--docs", action="store_true", help="append to docs/benchmarks.md")
    args = parser.parse_args()
    headers = ["model", "Conv+BN", "folded weights", "differ: fold of the FP16 weight",
               "differ: fold with torch ops", "FP32 scales differing (torch ops)"]
    rows = [measure(name) for name in args.models]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    body = "\n".join(lines)
    print(machine())
    print(body)
    if args.docs:
        append_docs("BatchNorm fold: which weight and which sqrt "
                    "(benchmarks/bn_fold_rounding.py)", body,
                    "Counts of folded Conv weights whose FP16 value differs from the numpy "
                    "fold of the FP32 weight rounded once (what the file holds).")


if __name__ == "__main__":
    main()
