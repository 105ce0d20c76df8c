"""Casts per training step: fxamp (numerics=off and default policy, cast placement on and
off) vs torch.autocast.

Counts every ATen call that changes a dtype (``aten._to_copy`` is what dispatches for
``Tensor.to(dtype)``, autocast's casts and ``ToCopyBackward``) with a TorchDispatchMode
(``fxamp.perf.count_casts``) over forward + backward of one training step, and the bytes
those casts write.

    python benchmarks/casts_per_step.py [--dtype bf16|fp16] [--batch 4] [--no-docs]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fxamp  # noqa: E402
from fxamp.perf import count_casts  # noqa: E402


def backward(out):
    out.float().sum().backward()


class _UpsampleConv(nn.Module):
    """FP32 input -> nearest upsample x4 -> conv: the cast placement pass's textbook case."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=4, mode="nearest"))


#: (label, policy): fxamp variants measured; "placement=off" keeps autocast's cast placement
VARIANTS = (("off", "numerics=off,placement=off"), ("off+pl", "numerics=off"),
            ("default -pl", "placement=off"), ("default", None))


def _moved(gm) -> int:
    return sum(1 for p in fxamp.plan_of(gm).nodes.values() if p.rule == "placement")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--only", default=None, help="substring of model names to run")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--detail", action="store_true", help="print per-kind breakdowns")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    torch.manual_seed(0)
    rows, notes = [], []
    cases = {**_common.models(a.batch), **_common.patterns(),
             "pattern: FP32 input -> upsample x4 -> conv": (
                 _UpsampleConv, (torch.randn(a.batch, 3, 16, 16),))}
    for name, (make, inputs) in cases.items():
        if a.only and a.only not in name:
            continue
        t0 = time.time()
        model = make().train()
        counts, moved = {}, {}

        def ac():
            with torch.autocast("cpu", dtype=dtype):
                return model(*inputs)
        model.zero_grad(set_to_none=True)
        try:
            counts["autocast"] = count_casts(ac, backward)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{name} / autocast: {type(e).__name__}: {str(e)[:300]}")
            counts["autocast"] = None
        for label, pol in VARIANTS:
            try:
                gm = fxamp.amp_rewrite(model, inputs,
                                       fxamp.RewriteConfig.make(dtype=dtype, target="cpu",
                                                                policy=pol))
                moved[label] = _moved(gm)
                model.zero_grad(set_to_none=True)
                counts[label] = count_casts(lambda: gm(*inputs), backward)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name} / {label}: {type(e).__name__}: {str(e)[:300]}")
                counts[label] = None
        ref = counts["autocast"]
        row = [name]
        for label in ("autocast",) + tuple(v[0] for v in VARIANTS):
            c = counts[label]
            if c is None:
                row += ["error", ""]
                continue
            row += [f"{c.n} ({c.phase('forward')}+{c.phase('backward')})",
                    f"{c.bytes / 2**20:.3f}"]
        on, off = counts["default"], counts["default -pl"]
        if on is not None and ref is not None:
            row.append(f"{on.n - ref.n:+d} casts, {(on.bytes - ref.bytes) / 2**20:+.3f} MiB "
                       f"({100 * (on.bytes - ref.bytes) / max(ref.bytes, 1):+.1f} %)")
        else:
            row.append("n/a")
        if on is not None and off is not None:
            row.append(f"{moved.get('default', 0)} nodes; {on.n - off.n:+d} casts, "
                       f"{(on.bytes - off.bytes) / 2**20:+.3f} MiB")
        else:
            row.append("n/a")
        rows.append(row)
        print(f"[{name}: {time.time() - t0:.1f}s]", flush=True)
        if a.detail:
            for label, c in counts.items():
                if c is None:
                    continue
                print(f"  {label}:")
                for k, v in sorted(c.by_kind.items()):
                    print(f"    {k}: {v} casts, {c.bytes_by_kind[k] / 2**20:.2f} MiB")
    headers = ["model", "autocast casts (fwd+bwd)", "MiB",
               "fxamp numerics=off,placement=off", "MiB", "fxamp numerics=off", "MiB",
               "fxamp placement=off", "MiB", "fxamp default", "MiB",
               "default vs autocast", "placement effect (default vs placement=off)"]
    md = _common.table(headers, rows)
    print(md)
    for n in notes:
        print("NOTE:", n)
    if not a.no_docs:
        body = (f"Casts per training step (forward + backward of `out.float().sum()`), "
                f"dtype {a.dtype}, target cpu, batch {a.batch}, 64x64 images, train mode. "
                f"Counted with `fxamp.perf.count_casts` (TorchDispatchMode; every dtype-"
                f"changing `aten._to_copy`/`copy_`/...), MiB = bytes written by the casts. "
                f"(fwd+bwd): the second phase is the loss (`out.float().sum()`, so a bf16 "
                f"output costs one cast there) plus autograd's backward. The `pattern:` rows are "
                f"small graphs (batch 2, seq 8, width 32) with the cast patterns where the two "
                f"can differ. fxamp columns: the numerics passes off/on (`numerics=off` / "
                f"default) with the cast placement pass (`passes/placement/`) off and on; "
                f"placement moved = nodes with `rule=placement` in the default plan.\n\n"
                + md)
        _common.append_docs("Casts per training step", body,
                            "\n".join(f"- {n}" for n in notes))


if __name__ == "__main__":
    main()
