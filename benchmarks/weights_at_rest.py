"""Inference with weights at rest in the plan's dtypes (the policy ``weights=stored``).

At batch 1 a forward is bound by reading weights: ``weights=cast`` (the default, as autocast)
reads each FP32 weight, writes a bf16 copy and reads that on every call; ``weights=stored``
keeps each weight in the dtype its nodes compute in, so a call reads bf16 weights once. Per
variant (the model under ``torch.autocast("cpu", bf16)``, fxamp ``weights=cast`` in place,
fxamp ``weights=stored`` in place, and the all-bf16 model ``copy.deepcopy(model).to(bf16)``,
the limit that has no FP32 islands) this prints, at each batch size, without grad:

- process CPU time per forward (``time.process_time``, 1 torch thread), the variants run
  interleaved, each round every variant ``--steps`` times, medians over rounds, and the
  ratio to the all-bf16 model per round (median);
- Python function calls of one forward (cProfile's count, builtins included);
- parameter bytes: every Parameter and buffer the variant holds (fxamp's low-precision
  copies of weights read in both dtypes included), each storage once.

The model is ``benchmarks/_decoder.py``'s decoder (its head tied to the token embedding,
which ``weights=stored`` keeps in FP32 with one bf16 copy: the embedding reads it in FP32,
as under autocast); ``--untied`` gives the head its own weight. The row
``weights=stored,bf16:wte,bf16:wpe`` adds overrides that run the embeddings in bf16 too: every
weight is then stored in bf16 alone, and the outputs are no longer autocast's.

    python benchmarks/weights_at_rest.py [--layers 3] [--d 512] [--vocab 6000] [--seq 16]
        [--batches 1 8] [--rounds 15] [--steps 5] [--untied] [--gpt2] [--docs]

``--gpt2`` adds a table for greedy ``generate`` (KV cache, batch 1) of a Hugging Face GPT-2
of the same size: CPU time per new token, whose decode steps are the batch-1 forwards the
policy is for (a GPT-2 rewrite keeps its eager root, each layer a graph).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _decoder import Decoder  # noqa: E402

import fxamp  # noqa: E402

BF16 = torch.bfloat16


class Untied(Decoder):
    """The decoder with a head of its own (not tied to the token embedding)."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.head = nn.Linear(self.wte.weight.shape[1], self.wte.weight.shape[0], bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.head.weight)


def _variants(model: nn.Module, x: torch.Tensor) -> Dict[str, nn.Module]:
    """name -> the module the variant calls (for autocast: the model itself)."""
    cast = fxamp.amp_rewrite(copy.deepcopy(model), (x,),
                             fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    stored = fxamp.amp_rewrite(copy.deepcopy(model), (x,),
                               fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                        policy="weights=stored"), inplace=True)
    # (an override: the embeddings too in bf16, so the tied weight is stored in bf16 alone;
    # no longer autocast's numbers, which read the embedding in FP32)
    low_emb = fxamp.amp_rewrite(copy.deepcopy(model), (x,),
                                fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                         policy="weights=stored,bf16:wte,bf16:wpe"),
                                inplace=True)
    return {"autocast": model, "fxamp weights=cast": cast, "fxamp weights=stored": stored,
            "fxamp weights=stored,bf16:wte,bf16:wpe": low_emb,
            "all-bf16 model": copy.deepcopy(model).to(BF16)}


def _call(name: str, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    if name != "autocast":
        return module

    def autocast(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return module(x)
    return autocast


def param_bytes(module: nn.Module) -> int:
    """Bytes of every Parameter and buffer ``module`` holds (for a model rewritten in place,
    also those its rewritten module holds of its own), each storage once.

    Args:
        module: the model.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    try:
        inner = fxamp.rewritten(module)
        tensors += list(inner.parameters()) + list(inner.buffers())
    except fxamp.FxampError:
        pass
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _calls(fn: Callable[[], object]) -> int:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return pstats.Stats(prof).total_calls


def _gpt2_table(args: argparse.Namespace) -> str:
    """Greedy ``generate`` of a GPT-2 as wide as the decoder (KV cache, batch 1): CPU time
    per new token for the same variants."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.d, n_layer=args.layers,
                                  n_head=8, n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, args.vocab, (1, args.seq))
    variants = {"autocast": model}
    for name, policy in (("fxamp weights=cast", None), ("fxamp weights=stored",
                                                        "weights=stored")):
        variants[name] = fxamp.amp_rewrite(copy.deepcopy(model), (ids,),
                                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                                    policy=policy), inplace=True)
    variants["all-bf16 model"] = copy.deepcopy(model).to(BF16)
    new = 8

    def generate(name: str) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16, enabled=name == "autocast"):
            return variants[name].generate(ids, max_new_tokens=new, do_sample=False,
                                           use_cache=True, pad_token_id=0)

    times: Dict[str, List[float]] = {n: [] for n in variants}
    with torch.no_grad():
        tokens = {name: generate(name) for name in variants}  # (and warm up)
        for _ in range(max(3, args.rounds // 3)):
            for name in variants:
                t0 = time.process_time()
                generate(name)
                times[name].append((time.process_time() - t0) / new * 1e3)
    limit = "all-bf16 model"
    rows = [[name, f"{statistics.median(times[name]):.2f}",
             f"{statistics.median(a / c for a, c in zip(times[name], times[limit])):.2f}",
             f"{param_bytes(m) / 1e6:.1f}",
             "yes" if torch.equal(tokens[name], tokens["autocast"]) else "no"]
            for name, m in variants.items()]
    return (f"GPT-2 ({args.layers} layers, d={args.d}, vocab {args.vocab}, tied head): greedy "
            f"generate with its KV cache, {args.seq}-token prompt, {new} new tokens, batch 1\n"
            + _common.table(["variant", "ms / new token (CPU)", "/ all-bf16", "parameter MB",
                             "= autocast's tokens"], rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=6000)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--untied", action="store_true", help="a head not tied to the embedding")
    ap.add_argument("--gpt2", action="store_true",
                    help="also time greedy generate of a GPT-2 of the same size (KV cache)")
    ap.add_argument("--docs", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cls = Untied if args.untied else Decoder
    model = cls(vocab=args.vocab, d=args.d, layers=args.layers, heads=8,
                context=args.seq).eval()
    xs = {b: torch.randint(0, args.vocab, (b, args.seq)) for b in args.batches}
    variants = _variants(model, xs[args.batches[0]])
    calls = {name: _call(name, m) for name, m in variants.items()}
    with torch.no_grad():
        want = calls["autocast"](xs[args.batches[0]]).float()
        same = {name: torch.equal(fn(xs[args.batches[0]]).float(), want)
                for name, fn in calls.items()}
    times: Dict[int, Dict[str, List[float]]] = {b: {n: [] for n in calls}
                                                for b in args.batches}
    with torch.no_grad():
        for b in args.batches:  # (warm up)
            for fn in calls.values():
                fn(xs[b])
        for _ in range(args.rounds):
            for b in args.batches:
                for name, fn in calls.items():
                    t0 = time.process_time()
                    for _ in range(args.steps):
                        fn(xs[b])
                    times[b][name].append((time.process_time() - t0) / args.steps * 1e3)
        n_calls = {name: _calls(lambda: fn(xs[args.batches[0]])) for name, fn in calls.items()}
    size = {name: param_bytes(m) for name, m in variants.items()}
    limit = "all-bf16 model"
    rows = []
    for name in calls:
        row = [name]
        for b in args.batches:
            ratio = statistics.median(a / c for a, c in zip(times[b][name], times[b][limit]))
            row += [f"{statistics.median(times[b][name]):.2f}", f"{ratio:.2f}"]
        row += [n_calls[name], f"{size[name] / 1e6:.1f}", f"{size[name] / size[limit]:.2f}",
                "yes" if same[name] else "no"]
        rows.append(row)
    headers = ["variant"]
    for b in args.batches:
        headers += [f"batch {b}: ms / forward (CPU)", "/ all-bf16"]
    headers += ["Python calls / forward", "parameter MB", "/ all-bf16", "= autocast's output"]
    table = _common.table(headers, rows)
    n_params = sum(p.numel() for p in model.parameters())
    what = (f"Decoder ({'untied head' if args.untied else 'head tied to the embedding'}): "
            f"{args.layers} layers, d={args.d}, vocab {args.vocab}, seq {args.seq}; "
            f"{n_params / 1e6:.1f}M parameters; no grad; 1 torch thread")
    print(what)
    print(table)
    if args.gpt2:
        gpt2 = _gpt2_table(args)
        print(gpt2)
        table += "\n\n" + gpt2
    if args.docs:
        _common.append_docs("Inference with weights at rest (benchmarks/weights_at_rest.py)",
                            table, f"{what}; process CPU time, {args.rounds} interleaved rounds "
                            f"of {args.steps} calls, medians.")


if __name__ == "__main__":
    main()
