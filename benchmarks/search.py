"""Tolerance search vs the bisection baseline: FP32 nodes kept and model evaluations used.

Run: python benchmarks/search.py [--no-docs]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import append_docs, table  # noqa: E402

import fxamp  # noqa: E402
from fxamp.rewriter.search import bisect_baseline, search  # noqa: E402


class Sensitive(nn.Module):
    """An MLP of tanh(Linear) layers; at a few spots values are scaled into fp16's
    subnormals and back, where fp16 loses them."""

    def __init__(self, depth: int, spots: tuple) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))
        self.spots = spots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i in self.spots:
                x = (x * 1e-6) * 1e6
        return x


class HotAttention(nn.Module):
    """Two attention layers; the second one's q.k^T passes fp16's max."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({k: nn.Linear(16, 16) for k in "qkv"})
                                    for _ in range(2))
        with torch.no_grad():
            self.blocks[1]["q"].weight.mul_(300)
            self.blocks[1]["k"].weight.mul_(300)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            s = b["q"](x) @ b["k"](x).transpose(-1, -2)
            x = x + torch.softmax(s, -1) @ b["v"](x)
        return x


def cases():
    torch.manual_seed(0)
    yield "MLP-12, 2 sensitive spots", Sensitive(12, (5, 9)), (4, 16), 5e-3
    yield "MLP-24, 3 sensitive spots", Sensitive(24, (3, 11, 19)), (4, 16), 5e-3
    yield "attention, one hot score", HotAttention(), (2, 6, 16), 1e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-docs", action="store_true",
                    help="print the table only; do not append it to docs/benchmarks.md")
    a = ap.parse_args()
    rows = []
    for name, model, shape, rtol in cases():
        data = [(torch.randn(*shape),) for _ in range(3)]
        low = sum(1 for p in fxamp.plan_of(fxamp.amp_rewrite(
            model, data[0], fxamp.RewriteConfig.make(target="cpu")))
                  .nodes.values() if p.dtype == torch.float16)
        row = [name, low, f"{rtol:g}"]
        for fn in (search, bisect_baseline):
            t = time.perf_counter()
            r = fn(model, data[0], data, fxamp.RewriteConfig.make(target="cpu"), rtol=rtol)
            row += [len(r.fp32_nodes), r.evaluations, f"{r.error:.2g}" + ("" if r.met else " (missed)"),
                    f"{time.perf_counter() - t:.1f}"]
        rows.append(row)
    headers = ["model", "fp16 nodes", "rtol", "search fp32 nodes", "search evals",
               "search error", "search s", "bisect fp32 nodes", "bisect evals", "bisect error",
               "bisect s"]
    text = table(headers, rows)
    print(text)
    if not a.no_docs:
        append_docs("Tolerance search vs bisection (CPU, fp16 plans, target cpu)", text,
                    "An evaluation is one rewrite run over the 3 data batches; the search's "
                    "scoring pass counts as one. Bisection: the shorter of an FP32 prefix and "
                    "an FP32 suffix of the fp16 nodes (Polygraphy `debug precision` style).")


if __name__ == "__main__":
    main()
