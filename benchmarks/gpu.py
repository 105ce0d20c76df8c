"""GPU benchmark: training throughput and peak memory, FP32 vs torch.autocast vs fxamp.

For fp16 and bf16, on ResNet-50 (224x224) and a BERT-base-sized encoder (12 layers, hidden
768, 12 heads, MLP 3072, sequence 128) with random weights: images (or sequences) per second
of a full training step (forward, FP32 loss, backward, SGD; GradScaler for fp16) and peak
CUDA memory. Variants run interleaved (rounds) and report medians. Runs in under five minutes
on a recent GPU with the defaults. Exits with a message (status 0) where CUDA is missing.

    python benchmarks/gpu.py [--rounds 5] [--steps 10] [--no-docs]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fxamp  # noqa: E402


class BertEncoder(nn.Module):
    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, mlp: int = 3072,
                 vocab: int = 30522, classes: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, 512, d))
        self.ln = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, heads, mlp, dropout=0.1, activation="gelu",
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.emb(idx) + self.pos[:, : idx.shape[1]])
        return self.head(self.enc(x)[:, 0])


def run_variant(step, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device is available (torch.cuda.is_available() is "
              "False); this benchmark needs a CUDA GPU. Nothing was measured.")
        return 0
    import torchvision
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    cases = {
        "resnet50 (224x224, batch 64)": (lambda: torchvision.models.resnet50(),
                                         lambda: torch.randn(64, 3, 224, 224, device=dev),
                                         1000, 64),
        "BERT-base-sized encoder (12L, 768, seq 128, batch 32)": (
            lambda: BertEncoder(), lambda: torch.randint(0, 30522, (32, 128), device=dev),
            2, 32),
    }
    rows = []
    for name, (make, make_x, classes, batch) in cases.items():
        for dname, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            torch.manual_seed(0)
            model = make().to(dev).train()
            x = make_x()
            y = torch.randint(0, classes, (batch,), device=dev)
            gm = fxamp.amp_rewrite(model, (x,), dtype=dtype, target="cuda")
            variants = {}
            for vname, fwd, ac in (("fp32", model, False), ("autocast", model, True),
                                   ("fxamp", gm, False)):
                opt = torch.optim.SGD(model.parameters(), lr=1e-4)
                scaler = torch.amp.GradScaler("cuda", enabled=(dtype == torch.float16
                                                               and vname != "fp32"))

                def step(fwd=fwd, ac=ac, opt=opt, scaler=scaler):
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast("cuda", dtype=dtype, enabled=ac):
                        out = fwd(x)
                    loss = F.cross_entropy(out.float(), y)
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                variants[vname] = step
            times = {k: [] for k in variants}
            peak = {}
            for k, step in variants.items():  # warm-up and peak memory, one at a time
                step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak[k] = torch.cuda.max_memory_allocated() / 2**30
            for _ in range(a.rounds):
                for k, step in variants.items():
                    times[k].append(run_variant(step, a.steps))
            med = {k: statistics.median(v) for k, v in times.items()}
            row = [name, dname]
            for k in variants:
                row.append(f"{batch / med[k]:.0f}/s, {peak[k]:.2f} GiB")
            row += [f"{med['autocast'] / med['fxamp']:.2f}", f"{med['fp32'] / med['fxamp']:.2f}",
                    f"{peak['fxamp'] / peak['autocast']:.2f}"]
            rows.append(row)
            print(row, flush=True)
            del model, gm, variants
            torch.cuda.empty_cache()
    md = _common.table(["model", "dtype", "fp32 (throughput, peak mem)", "autocast", "fxamp",
                        "fxamp speed-up vs autocast", "fxamp speed-up vs fp32",
                        "fxamp/autocast peak mem"], rows)
    print(md)
    if not a.no_docs:
        _common.append_docs(f"GPU training throughput ({torch.cuda.get_device_name()})",
                            f"{a.rounds} interleaved rounds x {a.steps} steps, medians.\n\n"
                            + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
