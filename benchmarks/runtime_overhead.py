"""What one call of a rewritten model costs next to torch.autocast, at batch 1.

On a GPU a small model's step is launch- and Python-bound, so the run-time's own work is the
step. Per variant (the FP32 model, the same model under ``torch.autocast("cpu", bf16)``,
fxamp not in place, fxamp in place as one graph (``partition="flat"``), fxamp in place
with the default partition (block mode: its blocks planned on the first call, made before
measuring; with an example it is the same); one model's FP32 Parameters for
all, the in-place ones on copies) this prints:

- process CPU time per call (``time.process_time``, 1 torch thread): a forward without grad
  (its logits as FP32, which fxamp's default ``output=fp32`` returns and autocast's bf16
  logits are cast to) and a training step (zero_grad + forward + FP32 cross-entropy +
  backward + AdamW step);
  variants run interleaved, each round every variant ``--steps`` times, medians over rounds,
  and the ratio to autocast per round (median);
- Python function calls of one training forward (cProfile's count, builtins included);
- extra bytes held between steps: live CPU tensor memory after two training steps and
  ``zero_grad(set_to_none=True)``, minus autocast's (the model, its gradients' absence and the
  optimizer state are the same for all), per parameter.

``fxamp guard=on`` is the opt-in range guard (a plan calibrated on the example input, every
low-precision node with a range checked per call): its cost, not a default.

``--model llama`` takes a tiny Hugging Face ``LlamaForCausalLM`` instead (``--d`` hidden,
``2 * --d`` MLP, 4 heads, 2 key-value heads, ``use_cache=False``; its logits are the output)
with the FP32, autocast and block-mode variants alone: block mode's decoder layers take
Python scalars and a tuple of tensors on every call, the per-call checks' hardest case.

    python benchmarks/runtime_overhead.py [--model decoder|llama] [--layers 4] [--d 256]
        [--vocab 50257] [--seq 32] [--batch 1] [--rounds 15] [--steps 5] [--docs]
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _decoder import Decoder  # noqa: E402

import fxamp  # noqa: E402

BF16 = torch.bfloat16
#: the variants ``--model llama`` runs
LLAMA_VARIANTS = ("fp32", "autocast", "fxamp blocks")


class Logits(torch.nn.Module):
    """A Hugging Face causal LM called on token ids, giving its logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _llama(args: argparse.Namespace) -> Logits:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.d,
                                   intermediate_size=2 * args.d,
                                   num_hidden_layers=args.layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=args.seq,
                                   use_cache=False)
    return Logits(transformers.LlamaForCausalLM(cfg))


def _variants(model: torch.nn.Module, x: torch.Tensor, only: str = "") -> Dict[str, Callable]:
    """The variants on ``model``'s Parameters (in place: on a copy); ``only``: that one."""
    def autocast(v: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return model(v)

    out: Dict[str, Callable] = {"fp32": model, "autocast": autocast}
    if isinstance(model, Logits):  # (block mode alone: the HF model's blocks rewritten)
        if only in ("", "fxamp blocks"):
            blocks = copy.deepcopy(model)
            fxamp.amp_rewrite(blocks.model,
                              config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                              inplace=True)
            with torch.no_grad():
                blocks(x)
            out["fxamp blocks"] = blocks
        return {k: out[k] for k in LLAMA_VARIANTS if k in out and (not only or k == only)}
    if only in ("", "fxamp inplace"):
        inplace = copy.deepcopy(model)
        out["fxamp inplace"] = fxamp.amp_rewrite(inplace, (x,), fxamp.RewriteConfig.make(
            dtype=BF16, target="cpu", partition="flat"), inplace=True)
    if only in ("", "fxamp blocks"):  # (in place, no example: planned on the first call)
        blocks = copy.deepcopy(model)
        out["fxamp blocks"] = fxamp.amp_rewrite(blocks,
                                                config=fxamp.RewriteConfig.make(dtype=BF16,
                                                                                target="cpu"),
                                                inplace=True)
        with torch.no_grad():
            blocks(x)
    if only in ("", "fxamp"):
        out["fxamp"] = fxamp.amp_rewrite(model, (x,),
                                         fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    if only in ("", "fxamp guard=on"):  # (the opt-in range guard: calibrated on the example)
        out["fxamp guard=on"] = fxamp.amp_rewrite(model, (x,),
                                                  fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                                           policy="guard=on",
                                                                           calibration_data=[(x,)]))
    order = ("fp32", "autocast", "fxamp", "fxamp inplace", "fxamp blocks", "fxamp guard=on")
    return {k: out[k] for k in order if k in out and (not only or k == only)}


def _params(name: str, fn: Callable, model: torch.nn.Module) -> List[torch.nn.Parameter]:
    return list((fn if name in ("fxamp inplace", "fxamp blocks") else model).parameters())


def _calls(fn: Callable) -> int:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return pstats.Stats(prof).total_calls


def _live_bytes() -> int:
    gc.collect()
    seen: Dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on deprecated torch objects warns)
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    del objects
    for obj in tensors:
        try:
            if obj.device.type == "cpu":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - tensors without storage
            continue
    return sum(seen.values())


def _held(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of CPU tensors alive after two training steps of a fresh copy of variant
    ``name`` and ``zero_grad(set_to_none=True)`` beyond its Parameters and optimizer state."""
    fresh = copy.deepcopy(model)
    fn = _variants(fresh, x, name)[name]
    params = _params(name, fn, fresh)
    opt = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(2):
        out = fn(x)
        F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del out
    own = {}
    for t in list(fresh.parameters()) + list(fresh.buffers()) + params + [
            v for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]:
        own[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    before = _live_bytes()  # (everything else alive in the process, this variant included)
    del fn, opt, fresh, params
    after = _live_bytes()
    return before - after - sum(own.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("decoder", "llama"), default="decoder")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--docs", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = (_llama(args) if args.model == "llama" else
             Decoder(vocab=args.vocab, d=args.d, layers=args.layers, heads=4, context=args.seq))
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    y = torch.randint(0, args.vocab, (args.batch * args.seq,))
    variants = _variants(model, x)
    n_params = sum(p.numel() for p in model.parameters())
    opts = {name: torch.optim.AdamW(_params(name, fn, model), lr=1e-4)
            for name, fn in variants.items()}

    def step(name: str) -> None:
        opt = opts[name]
        opt.zero_grad(set_to_none=True)
        out = variants[name](x)
        F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y).backward()
        opt.step()

    def forward(name: str) -> None:
        with torch.no_grad():  # (logits as FP32 for all: fxamp's output=fp32 default)
            variants[name](x).float()

    for name in variants:  # warm up (first calls, optimizer state)
        step(name)
        forward(name)
    times: Dict[str, Dict[str, List[float]]] = {k: {n: [] for n in variants}
                                                 for k in ("forward", "step")}
    for _ in range(args.rounds):
        for kind, fn in (("forward", forward), ("step", step)):
            for name in variants:
                t0 = time.process_time()
                for _ in range(args.steps):
                    fn(name)
                times[kind][name].append((time.process_time() - t0) / args.steps * 1e3)
    calls = {}
    for name, fn in variants.items():
        calls[name] = _calls(lambda: fn(x))
    held = {name: _held(name, model, x, y) for name in variants}
    rows = []
    for name in variants:
        ratio = {k: statistics.median(a / b for a, b in zip(times[k][name],
                                                           times[k]["autocast"]))
                 for k in times}
        rows.append([name, f"{statistics.median(times['forward'][name]):.2f}",
                     f"{ratio['forward']:.2f}", f"{statistics.median(times['step'][name]):.2f}",
                     f"{ratio['step']:.2f}", calls[name],
                     f"{calls[name] / calls['fp32']:.2f}",
                     f"{(held[name] - held['autocast']) / n_params:.2f}"])
    table = _common.table(["variant", "forward ms (CPU)", "/ autocast", "train step ms (CPU)",
                           "/ autocast", "Python calls / forward", "/ fp32",
                           "extra bytes held / param"], rows)
    what = ("Hugging Face LlamaForCausalLM (block mode)" if args.model == "llama"
            else "Decoder")
    print(f"{what}: {args.layers} layers, d={args.d}, vocab {args.vocab}, batch {args.batch}, "
          f"seq {args.seq}; {n_params / 1e6:.1f}M parameters; 1 torch thread")
    print(table)
    if args.docs:
        _common.append_docs(f"Run-time overhead per call at batch {args.batch} "
                            "(benchmarks/runtime_overhead.py)",
                            table, f"{what}: {args.layers} layers, d={args.d}, vocab "
                            f"{args.vocab}, batch {args.batch}, seq {args.seq}; process CPU "
                            "time, 1 torch "
                            f"thread, {args.rounds} interleaved rounds of {args.steps} calls, "
                            "medians; extra bytes: live CPU tensor memory after a training "
                            "step and zero_grad(set_to_none=True), minus autocast's.")


if __name__ == "__main__":
    main()
