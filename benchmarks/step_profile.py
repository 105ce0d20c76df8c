"""Where one training step's time goes: self CPU time per ATen op, per phase, per variant.

Profiles one model's steps (torch profiler, CPU) for the limit (the model in bf16), both
autocast settings and fxamp (the default ``weights=cast`` / ``o2``) and prints, per variant:
wall time of forward / loss / backward / optimizer step, the self CPU time of the ATen ops in
each phase (the rest of a phase's time is Python and dispatch outside ATen: the GraphModule's
code, fxamp's weight-cache checks, autograd Functions written in Python), the tensors cast
(``copy_`` between two dtypes: in ``_to_copy``, ``_foreach_copy_`` or in place) and the minor
page faults (fresh CPU memory) per phase, and the ops that take the most self CPU time.
Printed only (nothing is written to docs/).

    python benchmarks/step_profile.py [--models gpt2s] [--batch 1] [--seq 32] [--steps 3]
        [--variants limit,autocast,fxamp,fxamp o2] [--top 12] [--mode train|infer]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import cpu_step_time as cst  # noqa: E402

PHASES = ("forward", "loss", "backward", "optimizer")


FAULTS: dict = defaultdict(int)  # phase -> minor page faults (all steps run so far)


class phase:
    """A profiler range that also counts the minor page faults (fresh CPU memory) in it."""

    def __init__(self, name: str) -> None:
        self.name, self.range = name, record_function(name)

    def __enter__(self) -> None:
        self.f0 = _faults()
        self.range.__enter__()

    def __exit__(self, *exc) -> None:
        self.range.__exit__(*exc)
        FAULTS[self.name] += _faults() - self.f0


def _faults() -> int:
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def phased_step(fwd, params, target, mode, autocast=None, attach=None):
    """``cpu_step_time.make_step`` with a profiler range around each phase."""
    return cst.make_step(fwd, params, target, mode, autocast=autocast, attach=attach,
                         phase=phase)


def variants(model, inputs, target, mode, names):
    import copy
    import fxamp
    rw = lambda policy=None: fxamp.amp_rewrite(  # noqa: E731
        model, inputs, fxamp.RewriteConfig.make(dtype=cst.DT, target="cpu", policy=policy))
    params = list(model.parameters())
    out = {}
    for name in names:
        if name == "limit":
            low = copy.deepcopy(model).to(cst.DT)
            low_in = tuple(x.to(cst.DT) if x.is_floating_point() else x for x in inputs)
            out[name] = phased_step(lambda low=low: low(*low_in), list(low.parameters()),
                                    target, mode)
        elif name in ("autocast", "autocast nocache"):
            out[name] = phased_step(lambda: model(*inputs), params, target, mode,
                                    autocast=name == "autocast")
        elif name == "fxamp o2":  # its own copy (see cpu_step_time.variants)
            own = copy.deepcopy(model)
            gm = fxamp.amp_rewrite(own, inputs,
                                   fxamp.RewriteConfig.make(dtype=cst.DT, target="cpu",
                                                            policy="weights=o2"))
            out[name] = phased_step(lambda gm=gm: gm(*inputs), list(own.parameters()), target,
                                    mode, attach=gm)
        elif name in ("fxamp", "fxamp cast"):
            gm = rw(None if name == "fxamp" else "weights=cast")
            out[name] = phased_step(lambda gm=gm: gm(*inputs), params, target, mode)
        else:
            raise SystemExit(f"unknown variant {name!r}")
    return out


def phase_of(event) -> str:
    e = event.cpu_parent
    while e is not None:
        if e.name in PHASES:
            return e.name
        e = e.cpu_parent
    return "other"


def profile(step, steps: int):
    """(per-phase wall ms, per-phase ATen self ms, per-phase casts, op -> self ms, op -> count),
    per step."""
    FAULTS.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        for _ in range(steps):
            step()
    wall, aten, casts = defaultdict(float), defaultdict(float), defaultdict(int)
    ops, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.name in PHASES:
            wall[e.name] += e.cpu_time_total / 1e3 / steps
            continue
        if not e.name.startswith("aten::"):
            continue
        ph = phase_of(e)
        aten[ph] += e.self_cpu_time_total / 1e3 / steps
        ops[(ph, e.name)] += e.self_cpu_time_total / 1e3 / steps
        counts[(ph, e.name)] += 1
        dtypes = getattr(e, "input_dtypes", None) or []
        if e.name == "aten::copy_" and len(dtypes) >= 2 and dtypes[0] != dtypes[1]:
            casts[ph] += 1  # a tensor cast (in _to_copy, _foreach_copy_ or in place)
    return wall, aten, {k: v / steps for k, v in casts.items()}, ops, \
        {k: v / steps for k, v in counts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2s")
    ap.add_argument("--mode", choices=["train", "infer"], default="train")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up)")
    ap.add_argument("--timed", type=int, default=3, help="unprofiled timed rounds (medians)")
    ap.add_argument("--variants", default="limit,autocast,autocast nocache,fxamp,fxamp o2")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    names = a.variants.split(",")
    for model_name in a.models.split(","):
        torch.manual_seed(0)
        model, inputs, target = cst.build(model_name, a.batch, a.size, a.seq)
        model.train(a.mode == "train")
        steps = variants(model, inputs, target, a.mode, names)
        for s in steps.values():
            s()
            s()
        times = defaultdict(list)
        for _ in range(a.timed):
            for k, s in steps.items():
                t0 = time.perf_counter()
                s()
                times[k].append((time.perf_counter() - t0) * 1e3)
        print(f"\n# {model_name} {a.mode} batch {a.batch} (seq {a.seq}), threads "
              f"{torch.get_num_threads()}, torch {torch.__version__}; {_common.cpu_bf16()}")
        print("unprofiled ms/step (median of %d): " % a.timed + ", ".join(
            f"{k} {statistics.median(v):.1f}" for k, v in times.items()))
        for k, s in steps.items():
            wall, aten, casts, ops, counts = profile(s, a.steps)
            print(f"\n## {k}: profiled ms/step {sum(wall.values()):.1f}")
            print("| phase | wall ms | ATen self ms | rest (Python, dispatch) ms | casts "
                  "| page faults (k) |")
            print("|---|---|---|---|---|---|")
            for ph in PHASES:
                if ph in wall:
                    print(f"| {ph} | {wall[ph]:.1f} | {aten[ph]:.1f} | "
                          f"{wall[ph] - aten[ph]:.1f} | {casts.get(ph, 0):.0f} | "
                          f"{FAULTS[ph] / a.steps / 1e3:.1f} |")
            print(f"top {a.top} ops by self CPU (phase, op, ms/step, calls/step):")
            for (ph, op), ms in sorted(ops.items(), key=lambda kv: -kv[1])[:a.top]:
                print(f"  {ph:9s} {op:40s} {ms:8.2f} {counts[(ph, op)]:6.0f}")


if __name__ == "__main__":
    main()
