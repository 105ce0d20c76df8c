"""GPU training throughput and peak memory: fxamp vs torch.autocast vs the all-low limit.

For fp16 and bf16, on ResNet-50 (224x224) and a BERT-base-sized encoder (12 layers, hidden
768, 12 heads, MLP 3072, sequence 128) with random weights: samples per second of a full
training step (forward, FP32 loss, backward, SGD; GradScaler for fp16) and peak memory.
Variants (interleaved rounds, medians):

- ``fp32``; ``autocast``; ``fxamp`` (default policy);
- ``limit``: ``copy.deepcopy(model).to(dtype)``, inputs cast once: zero casts, no FP32 islands;
- CNNs: ``autocast NHWC`` (autocast on a channels_last copy, channels_last input) and
  ``fxamp channels_last`` (policy ``channels_last=on`` on its own copy);
- ``--compile``: ``torch.compile`` of the autocast model and of the fxamp GraphModule (and of
  their channels_last forms): compilation takes minutes, so it is off by default.

Every variant prints its line as soon as it is measured (flushed), then each model/dtype a
table row with fxamp/autocast speed-ups (>1: fxamp faster). Defaults run in well under 3
minutes on a recent GPU. ``--device cpu --smoke`` runs tiny sizes on the CPU end to end (what
the test suite does); without CUDA and without ``--device cpu`` it prints a message and exits 0.

    python benchmarks/gpu.py [--rounds 3] [--steps 5] [--batch 128] [--compile] [--no-docs]
    python benchmarks/gpu.py --device cpu --smoke --no-docs
"""
from __future__ import annotations

import argparse
import copy
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

CL = torch.channels_last


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


def cases(a, dev):
    """name -> (make model, make input, classes, batch, is_cnn)."""
    import torchvision
    if a.smoke:
        b = 2
        return {
            "resnet18 (32x32, smoke)": (lambda: torchvision.models.resnet18(num_classes=10),
                                        lambda: torch.randn(b, 3, 32, 32, device=dev), 10, b,
                                        True),
            "encoder (2L, 64, seq 16, smoke)": (
                lambda: BertEncoder(layers=2, d=64, heads=4, mlp=128, vocab=100),
                lambda: torch.randint(0, 100, (b, 16), device=dev), 2, b, False),
        }
    b = a.batch
    out = {
        f"resnet50 (224x224, batch {b})": (lambda: torchvision.models.resnet50(),
                                           lambda: torch.randn(b, 3, 224, 224, device=dev),
                                           1000, b, True),
        f"BERT-base-sized encoder (12L, 768, seq 128, batch {b // 4})": (
            lambda: BertEncoder(), lambda: torch.randint(0, 30522, (b // 4, 128), device=dev),
            2, b // 4, False),
    }
    return {k: v for k, v in out.items() if any(m in k.lower() for m in a.models.split(","))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 round x 1 step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128, help="ResNet batch (encoder: batch/4)")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--compile", action="store_true", help="add torch.compile variants")
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.steps = 1, 1
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device is available (torch.cuda.is_available() is "
              "False); this benchmark needs a CUDA GPU (or --device cpu --smoke). Nothing was "
              "measured.")
        return 0
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.backends.cudnn.benchmark = True
    t_start = time.perf_counter()
    rows = []
    for name, (make, make_x, classes, batch, cnn) in cases(a, dev).items():
        for dname in a.dtypes.split(","):
            dtype = fxamp.policy.parse_compute_dtype(dname)
            torch.manual_seed(0)
            model = make().to(dev).train()
            x = make_x()
            y = torch.randint(0, classes, (batch,), device=dev)
            target = "cuda" if cuda else "cpu"
            fwd = {"fp32": (model, x, False), "autocast": (model, x, True),
                   "fxamp": (fxamp.amp_rewrite(
                       model, (x,), fxamp.RewriteConfig.make(dtype=dtype, target=target)), x,
                             False)}
            low = copy.deepcopy(model).to(dtype)
            fwd["limit"] = (low, x.to(dtype) if x.is_floating_point() else x, False)
            if cnn:
                nhwc = copy.deepcopy(model).to(memory_format=CL)
                fwd["autocast NHWC"] = (nhwc, x.contiguous(memory_format=CL), True)
                cl_model = copy.deepcopy(model)
                cl_config = fxamp.RewriteConfig.make(dtype=dtype, target=target,
                                                     policy="channels_last=on")
                fwd["fxamp channels_last"] = (fxamp.amp_rewrite(cl_model, (x,), cl_config), x,
                                              False)
            if a.compile:
                for k in [k for k in fwd if k.startswith(("autocast", "fxamp"))]:
                    m, inp, ac = fwd[k]
                    fwd[k + " compiled"] = (torch.compile(m), inp, ac)
            steps = {}
            for k, (m, inp, ac) in fwd.items():
                params = [p for p in m.parameters()]
                opt = torch.optim.SGD(params, lr=1e-4)
                scaler = torch.amp.GradScaler(a.device, enabled=(dtype == torch.float16
                                                                 and k not in ("fp32", "limit")))

                def step(m=m, inp=inp, ac=ac, opt=opt, scaler=scaler):
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast(a.device, dtype=dtype, enabled=ac):
                        out = m(inp)
                    loss = F.cross_entropy(out.float(), y)
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                steps[k] = step
            peak = {}
            for k, step in steps.items():  # warm-up (compilation) and peak memory, one by one
                step()
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                step()
                sync()
                peak[k] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            times = {k: [] for k in steps}
            for r in range(a.rounds):
                for k, step in steps.items():
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(a.steps):
                        step()
                    sync()
                    times[k].append((time.perf_counter() - t0) / a.steps)
            med = {k: statistics.median(v) for k, v in times.items()}
            for k in steps:
                print(f"{name} {dname} {k}: {batch / med[k]:.0f}/s, peak {peak[k]:.2f} GiB "
                      f"[{time.perf_counter() - t_start:.0f} s]", flush=True)

            def speed(fast, slow):
                return f"{med[slow] / med[fast]:.3f}" if fast in med and slow in med else "-"
            row = [name, dname] + [f"{batch / med[k]:.0f}" for k in
                                   ("fp32", "autocast", "fxamp", "limit")]
            row += [speed("fxamp", "autocast"), speed("fxamp", "limit"),
                    f"{peak['fxamp'] / peak['autocast']:.2f}" if cuda else "-",
                    speed("fxamp channels_last", "autocast NHWC"),
                    speed("fxamp compiled", "autocast compiled"),
                    speed("fxamp channels_last compiled", "autocast NHWC compiled")]
            rows.append(row)
            print("ROW", row, flush=True)
            del model, fwd, steps, low
            if cuda:
                torch.cuda.empty_cache()
    md = _common.table(["model", "dtype", "fp32 /s", "autocast /s", "fxamp /s", "limit /s",
                        "fxamp vs autocast", "fxamp vs limit", "peak mem fxamp/autocast",
                        "fxamp channels_last vs autocast NHWC", "compiled: fxamp vs autocast",
                        "compiled channels_last: fxamp vs autocast NHWC"], rows)
    print(md)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    if not a.no_docs:
        where = torch.cuda.get_device_name() if cuda else "CPU"
        _common.append_docs(f"GPU-script training throughput ({where})",
                            f"{a.rounds} interleaved rounds x {a.steps} steps, medians; "
                            f"speed-ups are time ratios (>1: fxamp faster).\n\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
