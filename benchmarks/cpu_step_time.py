"""CPU training-step time: FP32 vs torch.autocast(bf16) vs fxamp bf16 (target="cpu").

One step = zero_grad + forward + cross-entropy (FP32) + backward + SGD step. The variants
share one model (same Parameters) and run interleaved: each round runs every variant for
``--steps`` steps and records the mean step time of that round; the table gives the median
over rounds, the spread (min-max over rounds) and the median of the per-round ratios.

With ``--channels-last`` a fourth variant, "fxamp channels_last" (policy
``channels_last=on``: conv weights and the input in NHWC), runs in the same rounds. That
policy converts the conv weights of the model it rewrites in place, so this variant rewrites
its own copy of the model (same initial weights, its own SGD); the other three keep NCHW.

    python benchmarks/cpu_step_time.py [--compile] [--channels-last] [--rounds 7] [--steps 3]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fxamp  # noqa: E402


def make_step(fwd, params, target, autocast_dtype=None):
    opt = torch.optim.SGD(params, lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        if autocast_dtype is not None:
            with torch.autocast("cpu", dtype=autocast_dtype):
                out = fwd()
        else:
            out = fwd()
        loss = F.cross_entropy(out.float(), target)
        loss.backward()
        opt.step()
        return loss
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="torch.compile (default backend) "
                    "the model / the fxamp GraphModule")
    ap.add_argument("--channels-last", action="store_true", help="add the variant 'fxamp "
                    "channels_last' (policy channels_last=on, on a copy of the model)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--models", default="resnet18,vit_small")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (1 makes the ratios far less sensitive to "
                    "other load on a small machine)")
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    rows, notes = [], []
    all_models = _common.models(a.batch, a.size)
    picks = {"resnet18": "resnet18", "vit_small": "vit_small(4L,128d)"}
    for short in a.models.split(","):
        name = picks.get(short, short)
        make, inputs = all_models[name]
        model = make().train()
        target = torch.randint(0, 10, (a.batch,))
        cl_model = copy.deepcopy(model) if a.channels_last else None
        gm = fxamp.amp_rewrite(model, inputs, dtype=dtype, target="cpu")
        fp32_fn, ac_fn, fx_fn = model, model, gm
        if a.compile:
            # three separate compiled callables (autocast is traced into its graph)
            fp32_fn = torch.compile(model)
            ac_fn = torch.compile(model)
            fx_fn = torch.compile(gm)
        params = list(model.parameters())
        variants = {
            "fp32": make_step(lambda: fp32_fn(*inputs), params, target),
            "autocast bf16": make_step(lambda: ac_fn(*inputs), params, target, dtype),
            "fxamp bf16": make_step(lambda: fx_fn(*inputs), params, target),
        }
        if cl_model is not None:
            cl_gm = fxamp.amp_rewrite(cl_model, inputs, dtype=dtype, target="cpu",
                                      policy="channels_last=on")
            cl_fn = torch.compile(cl_gm) if a.compile else cl_gm
            variants["fxamp channels_last"] = make_step(lambda: cl_fn(*inputs),
                                                        list(cl_model.parameters()), target)
        times = {k: [] for k in variants}
        cpu = {k: [] for k in variants}  # process CPU time per step (less hit by waiting)
        warm = {}
        broken = {}
        for k, step in variants.items():  # warm-up (and compilation) outside the rounds
            t0 = time.perf_counter()
            try:
                step()
                step()
            except Exception as e:  # noqa: BLE001
                broken[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
                notes.append(f"{name} / {k}{' (compiled)' if a.compile else ''} FAILED: "
                             f"{broken[k]}")
                traceback.print_exc()
            warm[k] = time.perf_counter() - t0
        for _ in range(a.rounds):
            for k, step in variants.items():
                if k in broken:
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(a.steps):
                    step()
                times[k].append((time.perf_counter() - t0) / a.steps * 1e3)
                cpu[k].append((time.process_time() - c0) / a.steps * 1e3)
        med = {k: statistics.median(v) for k, v in times.items() if v}

        def ratio(x, y):
            if x not in med or y not in med:
                return "n/a"
            r = [p / q for p, q in zip(times[x], times[y])]
            return (f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}); "
                    f"best/best {min(times[x]) / min(times[y]):.2f}")
        row = [name + (" compiled" if a.compile else "")]
        for k in variants:
            if k in med:
                row.append(f"{med[k]:.1f} (best {min(times[k]):.1f}, max {max(times[k]):.1f})")
            else:
                row.append("FAILED")
        row += [ratio("fxamp bf16", "autocast bf16"), ratio("autocast bf16", "fp32"),
                ratio("fxamp bf16", "fp32")]
        if a.channels_last:
            row += [ratio("fxamp channels_last", "autocast bf16"),
                    ratio("fxamp channels_last", "fxamp bf16")]
        cmed = {k: statistics.median(v) for k, v in cpu.items() if v}
        row.append(" / ".join(f"{cmed.get(k, float('nan')):.1f}" for k in variants))
        row.append(f"{cmed['fxamp bf16'] / cmed['autocast bf16']:.2f}"
                   if "fxamp bf16" in cmed and "autocast bf16" in cmed else "n/a")
        if a.channels_last:
            row.append(f"{cmed['fxamp channels_last'] / cmed['autocast bf16']:.2f}"
                       if "fxamp channels_last" in cmed and "autocast bf16" in cmed
                       else "n/a")
        row.append(" / ".join(f"{warm[k]:.1f}" for k in variants))
        rows.append(row)
        print(row, flush=True)
    cl = a.channels_last
    short = "fp32/ac/fxamp" + ("/fxamp-cl" if cl else "")
    headers = (["model", "fp32 ms/step median (min-max)", "autocast bf16", "fxamp bf16"]
               + (["fxamp channels_last"] if cl else [])
               + ["fxamp/autocast (per-round median (min-max); best/best)", "autocast/fp32",
                  "fxamp/fp32"]
               + (["fxamp channels_last/autocast", "fxamp channels_last/fxamp"] if cl else [])
               + [f"CPU ms/step median ({short})", "CPU-time fxamp/autocast"]
               + (["CPU-time fxamp channels_last/autocast"] if cl else [])
               + [f"warm-up s ({short})"])
    md = _common.table(headers, rows)
    print(md)
    for n in notes:
        print("NOTE:", n)
    if not a.no_docs:
        body = (f"Training step (zero_grad, forward, FP32 cross-entropy, backward, SGD) on CPU, "
                f"bf16, batch {a.batch}, {a.size}x{a.size} images (ViT: 4 layers, 128 hidden), "
                + ("torch.compile (default backend) of the model / the fxamp GraphModule, "
                   if a.compile else "eager, ")
                + ("with the variant 'fxamp channels_last' (policy channels_last=on, its own "
                   "copy of the model: conv weights and input in NHWC), " if cl else "") +
                f"{a.rounds} interleaved rounds x {a.steps} steps after 2 warm-up steps; "
                f"ms/step medians over rounds (best and worst round), ratios are medians of "
                f"per-round ratios (min-max) and the ratio of the best rounds (the least "
                f"disturbed by other load on the machine); CPU ms = process CPU time per step "
                f"(all threads), medians. torch threads: {torch.get_num_threads()}.\n\n" + md)
        _common.append_docs("CPU training-step time" + (" (torch.compile)" if a.compile
                                                         else " (eager)"), body,
                            "\n".join(f"- {n}" for n in notes))


if __name__ == "__main__":
    main()
