"""What never-stale weight copies cost: a gradient-accumulation window (K micro-batches,
then one fused AdamW step) and a forward without grad, per variant: torch.autocast, fxamp
default (``weights=cast``: every forward casts every weight, as autocast does, nothing kept
between steps), fxamp ``weights=cast`` spelled out and ``weights=o2`` (the attached optimizer's
step casts; micro-batches reuse).

    python benchmarks/accumulation.py [--micro 4] [--rounds 5] [--docs]

Interleaved rounds in one process; medians in ms.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import fxamp

from _common import append_docs, table
from _decoder import Decoder

BF16 = torch.bfloat16


def _variants(model: torch.nn.Module, idx: torch.Tensor) -> Dict[str, tuple]:
    out = {"autocast": (copy.deepcopy(model), None)}
    for policy in (None, "weights=cast", "weights=o2"):
        m = copy.deepcopy(model)
        gm = fxamp.amp_rewrite(m, (idx,),
                               fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy=policy))
        out[f"fxamp {policy or 'default'}"] = (gm, policy or "weights=cast")
    return out


def _window(model, policy, opt, idx, micro: int) -> Callable[[], None]:
    autocast = policy is None

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        for _ in range(micro):
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                logits = model(idx)
            F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()
        opt.step()
    return run


def _infer(model, policy, idx) -> Callable[[], None]:
    """A forward without grad after another one (an eval loop, ``generate``'s tokens)."""
    autocast = policy is None

    def run() -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
            model(idx)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--docs", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Decoder(vocab=8192, d=256, layers=4, heads=4, context=64)
    idx = torch.randint(0, 8192, (1, 32))
    runs: Dict[str, Dict[str, Callable[[], None]]] = {}
    for name, (m, policy) in _variants(model, idx).items():
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        if policy == "weights=o2":
            fxamp.train.attach_optimizer(m, opt)
        runs[name] = {"window": _window(m, policy, opt, idx, args.micro),
                      "infer": _infer(m, policy, idx)}
    times: Dict[str, Dict[str, List[float]]] = {n: {"window": [], "infer": []} for n in runs}
    for kind in ("window", "infer"):
        for fns in runs.values():
            fns[kind]()  # warm-up
    for _ in range(args.rounds):
        for name, fns in runs.items():
            for kind, fn in fns.items():
                if kind == "infer":
                    fn()  # the first forward after the step casts the weights it changed
                start = time.perf_counter()
                fn()
                times[name][kind].append(1e3 * (time.perf_counter() - start))
    base = {k: statistics.median(times["autocast"][k]) for k in ("window", "infer")}
    rows = []
    for name in runs:
        w, i = (statistics.median(times[name][k]) for k in ("window", "infer"))
        rows.append([name, f"{w:.1f}", f"{w / base['window']:.2f}", f"{i:.2f}",
                     f"{i / base['infer']:.2f}"])
    text = table(["variant", f"window of {args.micro} micro-batches ms", "/autocast",
                  "next forward without grad ms", "/autocast"], rows)
    print(text)
    if args.docs:
        append_docs("Accumulation windows and eval forwards with never-stale weight copies",
                    f"Decoder d=256, 4 layers, vocab 8192, batch 1, sequence 32, CPU bf16, "
                    f"fused AdamW; {args.rounds} interleaved rounds, medians.\n\n{text}")


if __name__ == "__main__":
    main()
