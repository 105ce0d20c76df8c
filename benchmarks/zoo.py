"""The zoo sweep: fxamp against ``torch.autocast("cpu", torch.bfloat16)`` on models nobody here
wrote, one training step and one eval forward each.

Models (benchmarks/_zoo_models.py): one timm model per architecture module (its ``test_*``
model, else its smallest), the torchvision classification, segmentation, video and detection
models, and Hugging Face architectures from tiny configs. Random weights; nothing is
downloaded (``HF_HUB_OFFLINE=1``).

Each model runs in its own process with a time limit. It is built once (``torch.manual_seed(0)``)
and deep-copied, so both sides start from the same weights:

- autocast: ``model.train()``; under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a forward
  (torch, numpy and ``random`` seeded with 1 first, so dropout, stochastic depth and
  SpecAugment masks draw the same numbers on both sides), then outside it the loss (the
  model's losses for detection models, else the sum of ``.float().sum()`` over the floating
  outputs) and its backward; then ``model.eval()`` and a
  forward under ``torch.no_grad()`` and autocast (seeded with 2 first);
- fxamp: ``fxamp.amp_rewrite(copy, config="cpu-bf16", inplace=True)`` (planned
  on its first call), the same training step and eval forward without autocast.

Class: **identical** (every output, the loss and every parameter gradient ``torch.equal``, same
dtypes, NaN where NaN), **close** (the largest relative difference, max |fxamp - autocast| / max
|autocast| per tensor, is <= 1e-3), **different** (above 1e-3), **refused** (fxamp raised an
``fxamp.FxampError`` subclass), **crashed** (any other exception, or the time limit, on fxamp's
side), **skipped** (the model does not build, or autocast itself fails). A training step that is
not identical is run once more under autocast on another copy: where autocast differs from itself
(torch's CPU bf16 kernels are not deterministic on every shape), the class is **autocast varies**,
with both differences. A training step whose outputs and loss are identical and whose differing
gradients all belong to modules called more than once in the step (counted with forward pre-hooks)
is **cast cache**: autocast casts such a weight once per region and sums the calls' gradients in
low precision through that one cast; fxamp casts per call of a graph and sums them in FP32
(docs/behaviour.md). Where a numerics rule decided a node of the plan and a result is
**different**, the model is rewritten again with ``numerics=off``: identical to autocast then is
**numerics rule** (the difference is that rule's decision, named in the plan).

    python benchmarks/zoo.py                         # everything; a markdown table on stdout
    python benchmarks/zoo.py --only 'resnet|bert'    # keys (family/name) matching a regex
    python benchmarks/zoo.py --family timm --limit 5 # the first 5 timm models
    python benchmarks/zoo.py --write                 # regenerate the zoo part of docs/coverage.md
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import datetime
import json
import os
import re
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _zoo_models as zm  # noqa: E402
import coverage as cov  # noqa: E402

MARK = cov.MARK
CLOSE = 1e-3          #: "close": the largest relative difference is at most this
CLASSES = ("identical", "close", "different", "autocast varies", "cast cache", "numerics rule",
           "refused", "crashed", "skipped (autocast fails)", "skipped (build fails)")
#: a model's class is the worst of its training step's and its eval forward's, in this order
ORDER = ("identical", "close", "autocast varies", "cast cache", "numerics rule", "different")
PARTIAL_DIR = "FXAMP_ZOO_PARTIAL_DIR"     # where a child leaves its record as it goes
THREADS = "FXAMP_ZOO_THREADS"
CPU_LIMIT = "FXAMP_ZOO_CPU_S"             # the child's CPU-time limit (RLIMIT_CPU)


# ---------------------------------------------------------------------------------------
# one model (in the child process)
# ---------------------------------------------------------------------------------------
def _leaves(value: Any) -> list:
    from fxamp.passes.annotate import float_leaves
    return float_leaves(value)


def _loss(out: Any) -> Any:
    """The model's losses (a dict of scalars: detection models in training) or the sum of
    ``.float().sum()`` over the floating outputs."""
    import torch
    leaves = _leaves(out)
    return sum((x.float().sum() for x in leaves), torch.zeros(()))


def compare(ref: List[Any], got: List[Any],
            upcast_ok: bool = False) -> Tuple[bool, Optional[float], str]:
    """(identical, max relative difference, note) over two lists of tensors (None allowed).
    With ``upcast_ok``, FP32 where autocast gives bf16/fp16 is fxamp's documented FP32 output
    (an exact upcast): the values are compared, the dtype does not count."""
    import torch
    if len(ref) != len(got):
        return False, float("inf"), f"{len(ref)} tensors under autocast, {len(got)} with fxamp"
    same, worst, note = True, 0.0, ""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a is None or b is None:
            if (a is None) != (b is None):
                return False, float("inf"), f"tensor {i}: None on one side only"
            continue
        if a.shape != b.shape:
            return False, float("inf"), f"tensor {i}: shapes {tuple(a.shape)} vs " \
                                        f"{tuple(b.shape)}"
        low = (torch.bfloat16, torch.float16)
        if a.dtype != b.dtype and not (upcast_ok and a.dtype in low and b.dtype == torch.float32):
            same = False
            note = note or f"tensor {i}: dtype {a.dtype} under autocast, {b.dtype} with fxamp"
        a, b = a.detach().float(), b.detach().float()
        nan_a, nan_b = a.isnan(), b.isnan()
        if not torch.equal(nan_a, nan_b):
            return False, float("inf"), f"tensor {i}: NaN at different places"
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
        if not torch.equal(a, b):
            same = False
            fin = a.isfinite() & b.isfinite()
            if not torch.equal(a[~fin], b[~fin]):
                return False, float("inf"), f"tensor {i}: inf at different places"
            scale = float(a[fin].abs().max()) if fin.any() else 0.0
            diff = float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
            worst = max(worst, rel)
    return same, worst, note


def _grads(model: Any) -> Tuple[List[str], List[Any]]:
    names, grads = [], []
    for n, p in model.named_parameters():
        names.append(n)
        grads.append(p.grad)
    return names, grads


def _worst_grad(ref: Any, got: Any) -> Tuple[bool, Optional[float], str]:
    """Gradients compared parameter by parameter: (identical, worst relative, its name)."""
    rn, rg = _grads(ref)
    gn, gg = _grads(got)
    if rn != gn:
        return False, float("inf"), "parameter names differ after the rewrite"
    same, worst, where = True, 0.0, ""
    for n, a, b in zip(rn, rg, gg):
        s, rel, note = compare([a], [b])
        same = same and s
        if rel is not None and rel > worst:
            worst, where = rel, n + (f" ({note})" if note else "")
        elif not s and not where:
            where = n + (f" ({note})" if note else "")
    return same, worst, where


def _seed(n: int) -> None:
    """Seed torch, numpy and random: Hugging Face's audio models draw their training masks
    (SpecAugment) with numpy."""
    import random

    import numpy as np
    import torch
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def _step(model: Any, args: tuple, kwargs: dict, autocast: bool,
          cache: bool = True) -> Tuple[Any, Any]:
    """One training forward (seeded) and the loss's backward; (outputs, loss). ``cache``:
    autocast's weight-cast cache (``cache_enabled``)."""
    import contextlib

    import torch
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache) if autocast
           else contextlib.nullcontext())
    model.train()
    _seed(1)
    with ctx:
        out = model(*args, **kwargs)
    loss = _loss(out)
    loss.backward()
    return out, loss


def _eval(model: Any, args: tuple, kwargs: dict, autocast: bool) -> Any:
    import contextlib

    import torch
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    model.eval()
    _seed(2)
    with torch.no_grad(), ctx:
        return model(*args, **kwargs)


def empty_record(key: str) -> Dict[str, Any]:
    family = _REG[key][0] if key in _REG else key.split("/", 1)[0]
    return {"key": key, "family": family, "model": key.split("/", 1)[1], "class": "",
            "stage": "", "failure": "", "input": "", "train_rel": None, "train_note": "",
            "grad_rel": None, "grad_where": "", "eval_rel": None, "eval_note": "",
            "train_class": "", "eval_class": "", "first_call_s": None}


_REG: Dict[str, Any] = {}


def _save(rec: Dict[str, Any]) -> None:
    """Leave the record so far where the parent finds it after a timeout."""
    d = os.environ.get(PARTIAL_DIR)
    if d:
        Path(d, re.sub(r"\W", "_", rec["key"]) + ".json").write_text(json.dumps(rec))


def _klass(same: bool, rel: Optional[float]) -> str:
    if same:
        return "identical"
    return "close" if rel is not None and rel <= CLOSE else "different"


def _called_again(model: Any, args: tuple, kwargs: dict) -> set:
    """The Parameters of the modules a training step under autocast calls more than once
    (by name): autocast casts such a weight once per region (its cast cache) and sums the
    calls' gradients in low precision; fxamp casts per call of a graph."""
    import collections
    calls: Dict[str, int] = collections.Counter()
    handles = [m.register_forward_pre_hook(lambda mod, inp, name=name: calls.update([name]))
               for name, m in model.named_modules()]
    try:
        _step(model, args, kwargs, autocast=True)
    finally:
        for h in handles:
            h.remove()
    owners = {name for name, n in calls.items() if n > 1}
    return {f"{m}.{p}" if m else p for m in owners
            for p, _ in model.get_submodule(m).named_parameters(recurse=False)}


def rules_of(model: Any) -> List[str]:
    """The numerics rules that decided a node of ``model``'s plans (every rewritten part of
    it: blocks are planned on their own)."""
    import fxamp
    from fxamp.policy import NUMERICS_RULES
    found = set()
    for part in model.modules():
        try:
            nodes = fxamp.plan_of(part).nodes.values()
        except fxamp.FxampError:
            continue
        found.update(str(getattr(n.rule, "value", n.rule)) for n in nodes)
    return sorted(found & set(NUMERICS_RULES))


def _numerics_off(rec: Dict[str, Any], model: Any, train_args: tuple, args: tuple,
                  kwargs: dict, ref: Any, ref_out: Any, ref_loss: Any, ref_eval: Any,
                  rules: List[str]) -> None:
    """Where a numerics rule decided a node, the same run with ``numerics=off``: a training
    step or eval forward identical to autocast's then is classed "numerics rule" (the
    difference is the rule's, named in the plan)."""
    import fxamp
    if not rules:
        return
    bare = copy.deepcopy(model)
    fxamp.amp_rewrite(bare, config="cpu-bf16,numerics=off", inplace=True)
    out, loss = _step(bare, train_args, kwargs, autocast=False)
    same_o, _, _ = compare(_leaves(ref_out) + [ref_loss], _leaves(out) + [loss], upcast_ok=True)
    if rec["train_class"] == "different" and same_o and _worst_grad(ref, bare)[0]:
        rec["train_class"] = "numerics rule"
    same_e, _, _ = compare(_leaves(ref_eval), _leaves(_eval(bare, args, kwargs, autocast=False)),
                           upcast_ok=True)
    if rec["eval_class"] == "different" and same_e:
        rec["eval_class"] = "numerics rule"
    rec["rules"] = ", ".join(rules)


def run_one(key: str) -> Dict[str, Any]:
    """Build the model, run autocast's and fxamp's training step and eval forward; the record."""
    import torch

    import fxamp
    if os.environ.get(THREADS):
        torch.set_num_threads(int(os.environ[THREADS]))
    if os.environ.get(CPU_LIMIT):     # SIGXCPU past it: the parent classes it as a timeout
        import resource
        limit = int(float(os.environ[CPU_LIMIT]))
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 10))
    _REG.update(zm.registry())
    rec = empty_record(key)
    rec["stage"] = "build"
    _save(rec)
    try:
        torch.manual_seed(0)
        model, args, kwargs, rec["input"] = _REG[key][1]()
        train_args = args
        if zm.is_detection(key):
            train_args = (args[0], zm.detection_targets(key))
        ref, amp, again = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001 - a bench problem, not fxamp's
        rec.update({"class": "skipped (build fails)", "failure": cov.failure_line(e)})
        return rec
    rec["stage"] = "autocast"
    _save(rec)
    try:
        ref_out, ref_loss = _step(ref, train_args, kwargs, autocast=True)
        ref_eval = _eval(ref, args, kwargs, autocast=True)
    except Exception as e:  # noqa: BLE001
        rec.update({"class": "skipped (autocast fails)", "failure": cov.failure_line(e)})
        return rec
    try:
        rec["stage"] = "amp_rewrite"
        _save(rec)
        fxamp.amp_rewrite(amp, config="cpu-bf16", inplace=True)
        rec["stage"] = "fxamp training step (first call: plans)"
        _save(rec)
        t0 = time.perf_counter()
        out, loss = _step(amp, train_args, kwargs, autocast=False)
        rec["first_call_s"] = round(time.perf_counter() - t0, 1)
        same_o, rel_o, note_o = compare(_leaves(ref_out) + [ref_loss], _leaves(out) + [loss],
                                         upcast_ok=True)
        same_g, rel_g, rec["grad_where"] = _worst_grad(ref, amp)
        rec["train_rel"], rec["train_note"], rec["grad_rel"] = rel_o, note_o, rel_g
        rec["train_class"] = _klass(same_o and same_g, max(rel_o or 0.0, rel_g or 0.0))
        if rec["train_class"] != "identical":  # (does autocast give itself the same?)
            again_out, again_loss = _step(again, train_args, kwargs, autocast=True)
            same_a, rel_a, _ = compare(_leaves(ref_out) + [ref_loss],
                                       _leaves(again_out) + [again_loss])
            same_ag, rel_ag, _ = _worst_grad(ref, again)
            if not (same_a and same_ag):
                rec["autocast_rel"] = max(rel_a or 0.0, rel_ag or 0.0)
                rec["train_class"] = "autocast varies"
        del again
        if rec["train_class"] == "different" and same_o:  # (autocast's cast cache?)
            shared = _called_again(copy.deepcopy(model), train_args, kwargs)
            differ = [n for n, a, b in zip(*_grads(ref), _grads(amp)[1])
                      if not compare([a], [b])[0]]
            if differ and set(differ) <= shared:
                rec["train_class"] = "cast cache"
                rec["shared"] = len(differ)
        rec["stage"] = "fxamp eval forward"
        _save(rec)
        got_eval = _eval(amp, args, kwargs, autocast=False)
        same_e, rec["eval_rel"], rec["eval_note"] = compare(_leaves(ref_eval), _leaves(got_eval),
                                                               upcast_ok=True)
        rec["eval_class"] = _klass(same_e, rec["eval_rel"])
        if "different" in (rec["train_class"], rec["eval_class"]):
            _numerics_off(rec, model, train_args, args, kwargs, ref, ref_out, ref_loss,
                          ref_eval, rules_of(amp))
        rec["class"] = max(rec["train_class"], rec["eval_class"], key=ORDER.index)
        rec["stage"] = ""
    except fxamp.FxampError as e:
        rec.update({"class": "refused", "failure": cov.failure_line(e)})
    except Exception as e:  # noqa: BLE001
        rec.update({"class": "crashed", "failure": cov.failure_line(e),
                    "traceback": traceback.format_exc()[-3000:]})
    return rec


# ---------------------------------------------------------------------------------------
# the driver (parent process)
# ---------------------------------------------------------------------------------------
def run_isolated(key: str, timeout: float, partial_dir: str) -> Dict[str, Any]:
    """One model in its own process; a timeout or a dead child is classed by the stage it
    reached (on autocast's side: skipped; on fxamp's: crashed)."""
    base = {**empty_record(key), "class": "crashed"}
    rec = cov.run_isolated(key, timeout, script=__file__, base=base)
    if "signal 24" in rec.get("failure", ""):   # SIGXCPU: the CPU-time limit
        rec["failure"] = f"timeout: no result within {os.environ[CPU_LIMIT]} s of CPU time"
    if rec.get("class") == "crashed" and not rec.get("traceback"):
        part = Path(partial_dir, re.sub(r"\W", "_", key) + ".json")
        if part.exists():
            saved = json.loads(part.read_text())
            rec = {**saved, "failure": rec["failure"], "wall_s": rec.get("wall_s"),
                   "class": rec["class"]}
            if saved["stage"] == "autocast":
                rec["class"] = "skipped (autocast fails)"
            elif saved["stage"] == "build":
                rec["class"] = "skipped (build fails)"
    return rec


def _num(x: Optional[float]) -> str:
    if x is None:
        return ""
    return "0" if x == 0 else f"{x:.1e}"


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def coarse(family: str) -> str:
    return "timm" if family.startswith("timm ") else family


def table(rows: List[Dict[str, Any]]) -> str:
    """Rows as a markdown table: class, then the train step's largest relative difference
    (outputs and loss; gradients, with the parameter), eval's, the first call's seconds and
    the failure (stage: exception type and first line)."""
    head = ["family", "model", "input", "class", "train: loss/outputs", "train: grads (worst)",
            "eval", "first call s", "failure / note"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        fail = r.get("failure", "")
        if fail and r.get("stage"):
            fail = f"{r['stage']}: {fail}"
        notes = "; ".join(n for n in (r.get("train_note"), r.get("eval_note")) if n)
        if r.get("autocast_rel") is not None:
            notes = "; ".join(filter(None, (notes, "autocast against itself: "
                                            + _num(r["autocast_rel"]))))
        if "cast cache" in (r.get("train_class"), r.get("eval_class")):
            notes = "; ".join(filter(None, (notes, f"outputs and loss identical; the "
                                            f"{r.get('shared')} gradients that differ are all "
                                            "of modules called several times per step")))
        if "numerics rule" in (r.get("train_class"), r.get("eval_class")):
            notes = "; ".join(filter(None, (notes, f"identical with numerics=off (rules that "
                                            f"decided: {r.get('rules', '')})")))
        grads = _num(r.get("grad_rel"))
        if r.get("grad_rel") and r.get("grad_where"):
            grads += f" ({r['grad_where']})"
        cells = [r["family"], r["model"], r.get("input", ""), r["class"],
                 _num(r.get("train_rel")), grads, _num(r.get("eval_rel")),
                 r.get("first_call_s") or "", fail or notes]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out)


def counts(rows: List[Dict[str, Any]]) -> str:
    """Counts per class, and per (coarse) family and class, as markdown."""
    total = collections.Counter(r["class"] for r in rows)
    lines = ["- " + ", ".join(f"{c}: {total[c]}" for c in CLASSES if total[c])
             + f" (of {len(rows)})"]
    train = collections.Counter(r["train_class"] for r in rows if r.get("train_class"))
    ev = collections.Counter(r["eval_class"] for r in rows if r.get("eval_class"))
    if train:
        lines.append("- of the models both sides ran: training step " + ", ".join(
            f"{c} {train[c]}" for c in ORDER if train[c]) + "; eval forward " + ", ".join(
            f"{c} {ev[c]}" for c in ORDER if ev[c]))
    fams = list(dict.fromkeys(coarse(r["family"]) for r in rows))
    used = [c for c in CLASSES if total[c]]
    lines += ["", "| family | models | " + " | ".join(used) + " |",
              "|---|---|" + "|".join("---" for _ in used) + "|"]
    for f in fams:
        c = collections.Counter(r["class"] for r in rows if coarse(r["family"]) == f)
        lines.append(f"| {f} | {sum(c.values())} | " + " | ".join(str(c[u]) for u in used)
                     + " |")
    return "\n".join(lines)


def write_doc(rows: List[Dict[str, Any]], cmd: str, date: str, elapsed: float,
              excluded: Dict[str, str], header_note: str = "") -> None:
    """Replace (or append) the zoo region of docs/coverage.md; the rest of it is kept."""
    import fxamp
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import cpu_bf16
    odd = [r for r in rows if r["class"] != "identical"]
    body = f"""{cov.ZOO_START}
## Against autocast: the zoo sweep

Generated by `benchmarks/zoo.py` (rerun it with `--write` to regenerate this section).
{header_note}
- date: {date} (start of the run)
- machine: {cov.machine()}; {cpu_bf16()}
- versions: {cov.versions()}, fxamp {fxamp.__version__} at commit {cov.git_commit()}
- command: `{cmd}` ({elapsed / 60:.0f} min)

Each model (random weights, built after `torch.manual_seed(0)`, deep-copied so both sides
start from the same weights) runs in its own process: a training step and an eval forward
under `torch.autocast("cpu", dtype=torch.bfloat16)`, and the same on a copy rewritten with
`fxamp.amp_rewrite(copy, config="cpu-bf16", inplace=True)` (planned on its
first call). The training step seeds torch, numpy and `random` (with 1) before the forward
on both sides, so dropout, stochastic depth and SpecAugment masks draw the same numbers;
its loss is the model's losses for detection models (with one target box per image) and the
sum of `.float().sum()` over the floating outputs otherwise; the eval forward
(`model.eval()`, `torch.no_grad()`) follows the training step on the same model objects.
fxamp returns FP32 outputs by default (`output=keep` keeps the computed dtype): an FP32
output where autocast gives bf16 is an exact upcast, so its values are compared and the
dtype does not count; every other dtype difference does.

Classes: **identical**: every output, the loss and every parameter gradient are
`torch.equal` (same dtypes, NaN at the same places); **close**: not identical, and the
largest relative difference (max |fxamp - autocast| / max |autocast|, per tensor) is at most
{CLOSE:g}; **different**: above {CLOSE:g}; **autocast varies**: a second autocast
training step on another copy differs from the first (torch's CPU bf16 kernels are not
deterministic on every shape), so fxamp cannot be compared bit for bit there (both
differences are shown); **cast cache**: the outputs and the loss are identical, and
every gradient that differs belongs to a module the step calls more than once (counted with
forward pre-hooks): autocast casts such a weight once per region and sums the calls'
gradients in bf16 through that one cast, fxamp casts per call of a graph and sums them in
FP32 (docs/behaviour.md gives the size on a siamese MLP and a GAN discriminator);
**numerics rule**: different, and identical to autocast when rewritten again with
`numerics=off` (the difference is the decision of the rules named, which the plan shows
with their reasons); **refused**: fxamp raised an `fxamp.FxampError`
subclass; **crashed**: any other exception on fxamp's side, or no result within the time
limit; **skipped**: the model does not build here, or autocast itself fails on it. The
model's class is the worse of its training step's and its eval forward's.

### Counts

{counts(rows)}

### Every model that is not identical

Columns: the largest relative difference of the training step's outputs and loss, of its
parameter gradients (with the worst parameter) and of the eval forward's outputs; the wall
seconds of fxamp's first (planning) call; the stage and first line of a failure, or where
the first difference is a dtype.

{table(odd) if odd else "None."}

### Excluded, and why

""" + ("\n".join(f"- `{k}`: {v}" for k, v in excluded.items()) or "- none") + \
        f"\n{cov.ZOO_END}\n"
    old = cov.DOC.read_text()
    i, j = old.find(cov.ZOO_START), old.find(cov.ZOO_END)
    if i >= 0 and j > i:
        text = old[:i] + body + old[j + len(cov.ZOO_END) + 1:]
    else:
        text = old.rstrip("\n") + "\n\n" + body
    cov.DOC.write_text(text)


def shown_args(argv: List[str]) -> List[str]:
    """The command line without the local files of --json / --resume (paths of this machine)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--resume"):
            skip = True
        elif not a.startswith(("--json=", "--resume=")):
            out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="regex: the models whose key (family/name) matches")
    ap.add_argument("--family", help="regex: the models whose family matches (timm modules "
                                     "are 'timm <module>')")
    ap.add_argument("--limit", type=int, help="the first N models")
    ap.add_argument("--timeout", type=float, default=120,
                    help="CPU seconds per model (120); the wall-clock limit is --wall")
    ap.add_argument("--wall", type=float, default=None,
                    help="wall seconds per model (default: 3x --timeout; a loaded machine "
                         "stretches wall time, not CPU time)")
    ap.add_argument("--resume", metavar="FILE",
                    help="keep the records of an earlier run's --json and run only the rest")
    ap.add_argument("--jobs", type=int, default=1,
                    help="models run at once (1); each child then uses one thread")
    ap.add_argument("--write", action="store_true",
                    help="regenerate the zoo section of docs/coverage.md")
    ap.add_argument("--json", help="also write the records to this JSON file as they come")
    ap.add_argument("--from-json", metavar="FILE", nargs="+",
                    help="print (and with --write, write) earlier runs' --json records; a "
                         "later file's record of a model replaces an earlier one's")
    ap.add_argument("--note", default="", help="a line for the doc's header (with --write)")
    ap.add_argument("--pick-timm", action="store_true",
                    help="print the timm picks (one model per module) and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one model in this process
    ns = ap.parse_args()
    if ns.one:
        print(MARK + json.dumps(run_one(ns.one)), flush=True)
        return
    if ns.pick_timm:
        for module, name in zm.pick_timm().items():
            print(f"    {module!r}: {name!r},")
        return
    if ns.from_json:
        saved = json.loads(Path(ns.from_json[0]).read_text())
        merged = {r["key"]: r for r in saved["rows"]}
        for extra in ns.from_json[1:]:
            merged.update({r["key"]: r for r in json.loads(Path(extra).read_text())["rows"]})
        rows = list(merged.values())
        print(table(rows) + "\n\n" + counts(rows))
        if ns.write:
            runs = [json.loads(Path(f).read_text()) for f in ns.from_json]
            elapsed = sum(run["elapsed_s"] for run in runs)
            main_run = max(runs, key=lambda run: len(run["rows"]))   # its command is shown
            words = [w for w in shown_args(shlex.split(main_run["command"]))
                     if not w.startswith("/")]
            write_doc(rows, " ".join(shlex.quote(w) for w in words), saved["date"], elapsed,
                      saved["excluded"], ns.note)
        return
    _REG.update(zm.registry())
    keys = list(_REG)
    if ns.family:
        keys = [k for k in keys if re.search(ns.family, _REG[k][0])]
    if ns.only:
        keys = [k for k in keys if re.search(ns.only, k)]
    excluded = {k: v for k, v in zm.EXCLUDED.items() if k in keys}
    keys = [k for k in keys if k not in zm.EXCLUDED]
    if ns.limit:
        keys = keys[:ns.limit]
    cmd = "python benchmarks/zoo.py " + " ".join(shlex.quote(a) for a in shown_args(sys.argv[1:]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if ns.jobs > 1:
        os.environ[THREADS] = "1"
    os.environ[CPU_LIMIT] = str(ns.timeout)
    done = {r["key"]: r for r in json.loads(Path(ns.resume).read_text())["rows"]} \
        if ns.resume else {}
    partial = tempfile.mkdtemp(prefix="fxamp-zoo-")
    os.environ[PARTIAL_DIR] = partial
    rows: Dict[str, Dict[str, Any]] = {k: r for k, r in done.items() if k in keys}
    t0 = time.perf_counter()
    wall = ns.wall or 3 * ns.timeout
    with concurrent.futures.ThreadPoolExecutor(max(1, ns.jobs)) as pool:
        futures = {pool.submit(run_isolated, k, wall, partial): k for k in keys
                   if k not in rows}
        for fut in concurrent.futures.as_completed(futures):
            rec = fut.result()
            rows[rec["key"]] = rec
            line = rec["class"] + (f" ({rec['stage']}: {rec['failure']})" if rec["failure"]
                                   else f" train {_num(rec['train_rel'])}/"
                                        f"{_num(rec['grad_rel'])} eval "
                                        f"{_num(rec['eval_rel'])}")
            print(f"[{len(rows)}/{len(keys)}] {rec['key']} ({rec.get('wall_s')} s): {line}",
                  file=sys.stderr, flush=True)
            if ns.json:
                Path(ns.json).write_text(json.dumps(
                    {"command": cmd, "date": date, "elapsed_s": time.perf_counter() - t0,
                     "excluded": excluded, "rows": [rows[k] for k in keys if k in rows]},
                    indent=1))
    ordered = [rows[k] for k in keys]
    print(table(ordered))
    print()
    print(counts(ordered))
    if ns.write:
        write_doc(ordered, cmd, date, time.perf_counter() - t0, excluded, ns.note)
        print(f"\nwrote {cov.DOC.relative_to(cov.ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
