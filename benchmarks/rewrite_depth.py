"""Rewrite time against depth: a tiny HF Llama (hidden 128) at 8, 32 and 80 decoder layers.

For each depth, interleaved in one process (medians over ``--repeat`` rounds, wall time):

- ``torch.export``: ``torch.export.export(model, (ids,), strict=False)`` of the FP32 model;
- ``flat``: ``amp_rewrite(model, (ids,), RewriteConfig.make(..., partition="flat"),
  inplace=True)`` (one graph of the whole model, traced up front from the example) followed
  by its first call;
- ``blocks``: ``amp_rewrite(model, inplace=True)`` with no example followed by its first
  call, which plans the blocks (identical decoder layers share one plan) and runs;
- ``blocks+example``: ``amp_rewrite(model, (ids,), config, inplace=True)`` (the default
  partition): the example is the first call, made in the rewrite (no call after it: the
  rewrite is the first call);
- ``blocks+cache``: as ``blocks``, with HF's default ``use_cache=True``: every decoder layer
  takes the eager front end (the KV cache is an object its code appends to), and identical
  ones share one eager plan.

The rewrites' rows include one forward (the first call); ``forward`` is a plain FP32
forward of the same model, for scale. bf16, target cpu. All depths run on the CPU: the
80-layer model holds 12 M parameters (48 MB). ``--meta-from N`` builds depths from N up on
``meta`` instead, where a model's own forward runs there (HF Llama's mask code calls
``.item()``, which ``meta`` refuses, so its forward and first call cannot run on ``meta``;
``torch.export`` can, and ``--meta-all`` keeps it).

    python benchmarks/rewrite_depth.py [--depths 8,32,80] [--repeat 3] [--write]
"""
from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_docs, table  # noqa: E402

import fxamp  # noqa: E402


def _llama(layers: int, device: str, cache: bool = False):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = cache
    return model.train()


#: the rewrites measured, in the table's order
_ROWS = ("flat", "blocks", "blocks+example", "blocks+cache")
_HEADERS = (["layers", "forward s", "torch.export s"] + [f"{k} s" for k in _ROWS]
            + [f"{k} / export" for k in _ROWS])


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(layers: int, device: str, repeat: int, meta_all: bool) -> dict:
    base = _llama(layers, device)
    cached = _llama(layers, device, cache=True)
    ids = torch.randint(0, 256, (2, 16), device=device)
    bf16 = fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu")
    run = {
        "forward": lambda m: m(ids),
        "torch.export": lambda m: torch.export.export(m, (ids,), strict=False),
        "flat": lambda m: fxamp.amp_rewrite(m, (ids,), bf16.replace(partition="flat"),
                                            inplace=True)(ids),
        "blocks": lambda m: fxamp.amp_rewrite(m,
                                              config=fxamp.RewriteConfig.make(dtype=torch.bfloat16,
                                                                              target="cpu"),
                                              inplace=True)(ids),
        "blocks+example": lambda m: fxamp.amp_rewrite(m, (ids,), bf16, inplace=True),
        "blocks+cache": lambda m: fxamp.amp_rewrite(m, config=bf16, inplace=True)(ids),
    }
    if device == "meta" and not meta_all:
        run = {k: v for k, v in run.items() if k in ("forward", "blocks")}
    times = {k: [] for k in run}
    for _ in range(repeat):
        for name, fn in run.items():
            model = copy.deepcopy(cached if name == "blocks+cache" else base)
            times[name].append(_timed(lambda: fn(model)))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="8,32,80")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--meta-from", type=int, default=10 ** 6,
                        help="depths from this one up are built on meta")
    parser.add_argument("--meta-all", action="store_true")
    parser.add_argument("--write", action="store_true", help="append to docs/benchmarks.md")
    args = parser.parse_args(argv)
    logging.getLogger("fxamp").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows, found = [], {}
    measure(2, "cpu", 1, args.meta_all)  # (warm-up: first-use costs of every path)
    for depth in (int(d) for d in args.depths.split(",")):
        device = "meta" if depth >= args.meta_from else "cpu"
        got = measure(depth, device, args.repeat, args.meta_all)
        found[depth] = got
        export = got.get("torch.export")
        rows.append([f"{depth} ({device})", f"{got['forward']:.2f}",
                     f"{export:.2f}" if export else "-"]
                    + [f"{got[k]:.2f}" if k in got else "-" for k in _ROWS]
                    + [f"{got[k] / export:.2f}x" if export and k in got else "-"
                       for k in _ROWS])
        print(table(_HEADERS, rows[-1:]), flush=True)
    depths = sorted(found)
    notes = ""
    if 8 in found and 32 in found:
        notes = "32 layers / 8 layers: " + "; ".join(
            f"{k} {found[32][k] / found[8][k]:.2f}x" for k in _ROWS if k in found[8])
    body = table(_HEADERS, rows)
    print(body)
    if notes:
        print(notes)
    if args.write:
        append_docs(f"Rewrite time against depth ({', '.join(map(str, depths))} layers)",
                    body, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
