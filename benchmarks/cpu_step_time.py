"""CPU step time, bf16: fxamp (each weights option) vs both autocast settings vs the limit.

Variants, all on one model's FP32 Parameters except the limit and o2 (its own copy):

- ``fp32``: the model as is;
- ``autocast``: ``torch.autocast("cpu", bf16)`` (weight-cast cache on, the default);
- ``autocast nocache``: ``torch.autocast(..., cache_enabled=False)`` (the faster setting at
  small batch on CPU);
- ``limit``: ``copy.deepcopy(model).to(bf16)`` (inputs cast once outside the step): zero casts,
  no FP32 islands, the fastest a mixed-precision rewrite could get;
- ``fxamp``: ``amp_rewrite`` default (``weights=cast``: every weight cast on every forward, in
  the graph, as autocast casts it);
- ``fxamp cast``: policy ``weights=cast`` spelled out (the same as the default);
- ``fxamp o2``: policy ``weights=o2`` + ``fxamp.train.attach_optimizer`` (the optimizer step
  writes the bf16 copies);
- ``fxamp channels_last`` (``--channels-last``): policy ``channels_last=on`` on its own copy.

With ``--mode train`` the table also gives **the FP32-master bound**: the limit's step plus
what keeping FP32 master weights adds to any mixed-precision step whose masters and gradients
are autocast's: each weight cast to bf16 and each bf16 gradient cast to FP32 (one ``copy_``
per tensor into existing memory: no page faults) and SGD on FP32 instead of bf16 tensors,
timed in the same rounds. It leaves out the FP32 islands and the FP32 embedding gradient, so
it is a lower bound: fxamp/autocast cannot go below bound/autocast without changing the
numbers. Not with ``--compile`` (the parts run eagerly).

``--mode train``: zero_grad + forward + FP32 cross-entropy + backward + SGD step;
``--mode infer``: forward under ``torch.no_grad()``. Variants run interleaved: each round runs
every variant ``--steps`` times; the table gives median ms/step over rounds, then
fxamp/autocast against the FASTER of the two autocast settings (per-round ratios, median),
fxamp/limit, per variant the minor page faults per step (fresh CPU tensors), and the
launches of one profiled step (torch profiler: all ATen ops,
and the tensors cast among them: ``copy_`` between two dtypes, in ``_to_copy``, in a
``_foreach_copy_`` or into an existing tensor).

Models (``--models``): resnet18, resnet50, vit_b_16 (torchvision, ``--size`` images),
vit_small (4 layers, 128 hidden), gpt2s (GPT-2-small-sized decoder, benchmarks/_decoder.py,
sequence ``--seq``), gpt_tiny (4 layers, d=256, vocab 8000). The defaults are short; the
machine is shared: prefer ``--threads 1`` and read the ratios.

    python benchmarks/cpu_step_time.py [--mode train|infer] [--models resnet18,gpt_tiny]
        [--batch 1] [--rounds 5] [--steps 2] [--threads 1] [--compile] [--channels-last]
"""
from __future__ import annotations

import argparse
import contextlib
import os
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
import _decoder  # noqa: E402

import fxamp  # noqa: E402

DT = torch.bfloat16


def build(name: str, batch: int, size: int, seq: int):
    """(model, inputs, target) for a model name."""
    import torchvision
    img = (torch.randn(batch, 3, size, size),)
    cls = torch.randint(0, 10, (batch,))
    if name in ("resnet18", "resnet50"):
        return getattr(torchvision.models, name)(num_classes=10), img, cls
    if name == "vit_b_16":
        return torchvision.models.VisionTransformer(
            image_size=size, patch_size=16, num_layers=12, num_heads=12, hidden_dim=768,
            mlp_dim=3072, num_classes=10), img, cls
    if name == "vit_small":
        return _common.small_vit(size), img, cls
    if name in ("gpt2s", "gpt_tiny"):
        cfg = dict(vocab=50257, d=768, layers=12, heads=12) if name == "gpt2s" else \
            dict(vocab=8000, d=256, layers=4, heads=4)
        model = _decoder.Decoder(**cfg)
        idx = torch.randint(0, cfg["vocab"], (batch, seq))
        return model, (idx,), torch.randint(0, cfg["vocab"], (batch, seq))
    raise SystemExit(f"unknown model {name!r}")


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, -2) if out.dim() > 2 else out.float(),
                           target.flatten() if out.dim() > 2 else target)


def make_step(fwd, params, target, mode, autocast=None, attach=None, phase=None):
    """One training step (or one no_grad forward) of ``fwd``; ``phase(name)``, if given, is a
    context manager put around each phase (forward, loss, backward, optimizer)."""
    span = phase or (lambda name: contextlib.nullcontext())

    def forward():
        with span("forward"):
            if autocast is not None:
                with torch.autocast("cpu", dtype=DT, cache_enabled=autocast):
                    return fwd()
            return fwd()

    if mode == "infer":
        def infer():
            with torch.no_grad():
                return forward()
        return infer
    opt = torch.optim.SGD(params, lr=1e-4)
    if attach is not None:
        fxamp.train.attach_optimizer(attach, opt)

    def step():
        with span("optimizer"):
            opt.zero_grad(set_to_none=True)
        out = forward()
        with span("loss"):
            loss = loss_of(out, target)
        with span("backward"):
            loss.backward()
        with span("optimizer"):
            opt.step()
        return loss
    return step


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing): every
    fresh large CPU tensor faults its pages in, a cost the load of a shared machine does not
    change."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def launches(step) -> str:
    """ATen ops / tensors cast in one step (torch profiler): a cast is a ``copy_`` between
    two dtypes, whether ``_to_copy`` runs it, a ``_foreach_copy_`` (one launch for a list on
    a GPU, one ``copy_`` per tensor on CPU) or a copy into an existing tensor."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        step()
    ops = casts = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        ops += 1
        dtypes = getattr(e, "input_dtypes", None) or []
        if e.name == "aten::copy_" and len(dtypes) >= 2 and dtypes[0] != dtypes[1]:
            casts += 1
    return f"{ops}/{casts}"


def bound_parts(model, low, lr: float = 1e-4):
    """The pieces of the FP32-master bound, each a step function timed with the variants:
    ``casts`` (every weight FP32 -> bf16 and every gradient bf16 -> FP32, into existing
    tensors), ``sgd fp32`` and ``sgd bf16`` (torch.optim.SGD's per-tensor update on CPU)."""
    masters = [p.detach().clone() for p in model.parameters()]
    copies = [torch.empty_like(p, dtype=DT) for p in masters]
    grads_low = [torch.full_like(p, 1e-3, dtype=DT) for p in masters]
    grads = [torch.empty_like(p) for p in masters]
    lows = [p.detach().clone() for p in low.parameters()]

    def casts():
        for c, m in zip(copies, masters):
            c.copy_(m)
        for g, gl in zip(grads, grads_low):
            g.copy_(gl)

    def sgd(params, gs):
        def step():
            for p, g in zip(params, gs):
                p.add_(g, alpha=-lr)
        return step
    return {"casts": casts, "sgd fp32": sgd(masters, grads), "sgd bf16": sgd(lows, grads_low)}


def bound_ms(times: dict, parts: dict) -> list:
    """Per round: limit + casts + (SGD fp32 - SGD bf16), ms per step."""
    return [lim + c + s32 - s16 for lim, c, s32, s16 in
            zip(times["limit"], parts["casts"], parts["sgd fp32"], parts["sgd bf16"])]


def variants(model, inputs, target, mode, a):
    """name -> step function."""
    rewrite = lambda m, policy=None: fxamp.amp_rewrite(  # noqa: E731
        m, inputs, fxamp.RewriteConfig.make(dtype=DT, target="cpu", policy=policy))
    wrap = torch.compile if a.compile else (lambda f: f)
    params = list(model.parameters())
    # o2 trains its own copy of the model: its copies are re-cast by its own optimizer step
    # only, so another variant's step on shared Parameters would leave them stale and make
    # its next forward cast every weight as well (twice the casts in that step)
    o2_model = copy.deepcopy(model)
    gm, gm_cast = rewrite(model), rewrite(model, "weights=cast")
    gm_o2 = rewrite(o2_model, "weights=o2")
    low = copy.deepcopy(model).to(DT)
    low_in = tuple(x.to(DT) if x.is_floating_point() else x for x in inputs)
    f = {k: wrap(m) for k, m in (("fp32", model), ("ac", model), ("acn", model), ("low", low),
                                  ("fx", gm), ("fxc", gm_cast), ("fxo", gm_o2))}
    out = {
        "fp32": make_step(lambda: f["fp32"](*inputs), params, target, mode),
        "autocast": make_step(lambda: f["ac"](*inputs), params, target, mode, autocast=True),
        "autocast nocache": make_step(lambda: f["acn"](*inputs), params, target, mode,
                                      autocast=False),
        "limit": make_step(lambda: f["low"](*low_in), list(low.parameters()), target, mode),
        "fxamp": make_step(lambda: f["fx"](*inputs), params, target, mode),
        "fxamp cast": make_step(lambda: f["fxc"](*inputs), params, target, mode),
        "fxamp o2": make_step(lambda: f["fxo"](*inputs), list(o2_model.parameters()), target,
                              mode, attach=gm_o2),
    }
    if a.channels_last:
        cl_model = copy.deepcopy(model)
        cl = wrap(rewrite(cl_model, "channels_last=on"))
        out["fxamp channels_last"] = make_step(lambda: cl(*inputs), list(cl_model.parameters()),
                                               target, mode)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["train", "infer"], default="train")
    ap.add_argument("--compile", action="store_true", help="torch.compile (default backend) "
                    "every variant's module")
    ap.add_argument("--channels-last", action="store_true", help="add 'fxamp channels_last' "
                    "(policy channels_last=on, on a copy of the model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,8,64")
    ap.add_argument("--size", type=int, default=64, help="image size (ResNet / ViT)")
    ap.add_argument("--seq", type=int, default=32, help="sequence length (decoders)")
    ap.add_argument("--models", default="resnet18,gpt_tiny")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (1 makes the ratios far less sensitive to "
                    "other load on a small machine)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time steps by wall clock or by this process's CPU time (user + "
                    "system: page faults included); cpu is far steadier on a busy machine")
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    rows, notes, names = [], [], None
    for name in a.models.split(","):
        for batch in (int(b) for b in a.batch.split(",")):
            torch.manual_seed(0)
            model, inputs, target = build(name, batch, a.size, a.seq)
            model.train(a.mode == "train")
            steps = variants(model, inputs, target, a.mode, a)
            names = list(steps)
            bounded = a.mode == "train" and not a.compile  # (the parts run eagerly)
            parts = bound_parts(model, copy.deepcopy(model).to(DT)) if bounded else {}
            part_ms = {k: [] for k in parts}
            times = {k: [] for k in steps}
            faults = {k: [] for k in steps}
            broken, counts = {}, {}
            for k, step in steps.items():  # warm-up (compilation) outside the rounds
                try:
                    step()
                    step()
                    counts[k] = launches(step)
                except Exception as e:  # noqa: BLE001
                    broken[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    notes.append(f"{name} batch {batch} / {k} FAILED: {broken[k]}")
                    traceback.print_exc()
            for _ in range(a.rounds):
                for k, step in steps.items():
                    if k in broken:
                        continue
                    f0 = _minor_faults()
                    t0 = clock()
                    for _ in range(a.steps):
                        step()
                    times[k].append((clock() - t0) / a.steps * 1e3)
                    faults[k].append((_minor_faults() - f0) / a.steps)
                for k, part in parts.items():
                    part()
                    t0 = clock()
                    for _ in range(a.steps):
                        part()
                    part_ms[k].append((clock() - t0) / a.steps * 1e3)
            if parts and times["limit"]:
                times["bound"] = bound_ms(times, part_ms)
            med = {k: statistics.median(v) for k, v in times.items() if v}

            def ratio(x, y):
                if x not in med or y not in med:
                    return "n/a"
                r = [p / q for p, q in zip(times[x], times[y])]
                return f"{statistics.median(r):.2f}"
            peer = min(("autocast", "autocast nocache"), key=lambda k: med.get(k, float("inf")))
            row = [name, a.mode, str(batch)]
            row += [f"{med[k]:.1f}" if k in med else "FAILED" for k in names]
            row += [peer.replace("autocast", "ac")]
            for k in ("fxamp", "fxamp cast", "fxamp o2"):
                row.append(f"{ratio(k, peer)} / {ratio(k, 'limit')}")
            if parts:
                row.append(f"{med['bound']:.1f}" if "bound" in med else "n/a")
                row.append(f"{ratio('bound', peer)} / {ratio('fxamp', 'bound')}")
            row.append(" ".join(counts.get(k, "-") for k in names))
            row.append(" ".join(f"{statistics.median(faults[k]) / 1e3:.0f}" if faults[k]
                                else "-" for k in names))
            rows.append(row)
            print(row, flush=True)
    headers = (["model", "mode", "batch"] + [f"{k} ms" for k in names]
               + ["faster autocast", "fxamp: /autocast / /limit", "fxamp cast: /ac / /limit",
                  "fxamp o2: /ac / /limit"]
               + (["FP32-master bound ms", "bound/ac / fxamp/bound"]
                  if a.mode == "train" and not a.compile else [])
               + ["ATen ops/tensors cast per step (" + ", ".join(names) + ")",
                  "page faults per step, thousands (same order)"])
    md = _common.table(headers, rows)
    print(md)
    for n in notes:
        print("NOTE:", n)
    if not a.no_docs:
        what = ("zero_grad, forward, FP32 cross-entropy, backward, SGD" if a.mode == "train"
                else "forward under no_grad")
        body = (f"CPU bf16, {a.mode} ({what}), "
                + ("torch.compile of every module, " if a.compile else "eager, ")
                + f"images {a.size}x{a.size}, sequence {a.seq}; {a.rounds} interleaved rounds "
                f"x {a.steps} steps after 2 warm-up steps; ms/step medians ("
                + ("process CPU time, user + system" if a.clock == "cpu" else "wall clock")
                + f"); ratios are medians "
                f"of per-round ratios, against the faster autocast setting ('ac' = "
                f"cache_enabled=True, 'ac nocache' = cache_enabled=False) and against the limit "
                f"(the model in bf16, no casts)"
                + ("; the FP32-master bound is the limit plus every weight and gradient "
                   "cast into existing memory and the FP32-vs-bf16 SGD difference (no FP32 "
                   "islands: a lower bound for a step bit-identical to autocast's)"
                   if a.mode == "train" and not a.compile else "")
                + f". Load average at the end (1 min): "
                f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} logical cores. "
                f"torch threads: {torch.get_num_threads()}.\n\n" + md)
        _common.append_docs(f"CPU step time vs autocast and the limit ({a.mode}"
                            + (", torch.compile" if a.compile else "") + ")", body,
                            "\n".join(f"- {n}" for n in notes))


if __name__ == "__main__":
    main()
