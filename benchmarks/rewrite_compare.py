"""amp_rewrite time of this fxamp against another checkout of it, interleaved in one process.

For each model and (dtype, target): the front end's own plain trace (static
``torch.fx.symbolic_trace`` / ``torch.export.export(strict=False)``), a rewrite by the other
checkout ("before", imported from ``--before-src`` under another package name) and one by
this one ("after"), interleaved ``--repeat`` times; process CPU seconds, medians. The caches
fxamp keeps across rewrites (autocast oracle, norm-eps probes) are emptied before every
rewrite (each is a first one, as in a fresh process) and a full garbage collection runs
(untimed) before every rewrite and trace, so that none pays for another's garbage.

The two plans' text (``str(plan_of(gm))``, first round) must be identical: a row says "PLAN
DIFFERS" otherwise, or "same but constant names" where only fx's numbering of tensor
constants differs (a plain fx trace of some models shifts it for later traces). "bare fake
run" is one FakeTensorProp run of the front end's plain graph: the floor of a rewrite that
learns dtypes by running the graph on fake tensors. With ``--phases`` each version's last
rewrite is also split by phase (process CPU time of the outermost calls, inclusive).

    python benchmarks/rewrite_compare.py --before-src OLD/src [--repeat 3]
        [--models tv/resnet50,timm/mobilevit_xxs:64,hf/bert] [--configs bf16/cpu,fp16/cuda]

Models: ``tv/NAME`` (torchvision, 64x64), ``timm/NAME:SIZE``, ``hf/NAME`` (the small
Hugging Face configurations of benchmarks/coverage.py); batch 2, random weights, eval mode.
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib
import importlib.util
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MODELS = ("tv/resnet50,timm/swin_tiny_patch4_window7_224:224,timm/resnet18:64,"
          "timm/mobilevit_xxs:64,timm/efficientvit_b0:64,timm/maxvit_tiny_tf_224:224,"
          "hf/bert,hf/gpt2,hf/t5")


def build(key: str) -> Tuple[torch.nn.Module, tuple, dict]:
    """(model in eval mode, args, kwargs) for a ``--models`` entry."""
    torch.manual_seed(0)
    family, name = key.split("/", 1)
    if family == "tv":
        import torchvision
        return (torchvision.models.get_model(name, weights=None).eval(),
                (torch.randn(2, 3, 64, 64),), {})
    if family == "timm":
        import timm
        name, size = (name.split(":") + ["224"])[:2]
        return (timm.create_model(name, pretrained=False).eval(),
                (torch.randn(2, 3, int(size), int(size)),), {})
    if family == "hf":
        import coverage
        model, args, kwargs, _ = coverage.HF[name]()
        return model.eval(), tuple(args), dict(kwargs)
    raise SystemExit(f"unknown model family in {key!r}: tv/, timm/ or hf/")


def load_as(src: str, name: str) -> Any:
    """The ``fxamp`` package under ``src`` imported as the top-level package ``name``."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(src, "fxamp", "__init__.py"),
        submodule_search_locations=[os.path.join(src, "fxamp")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Phases:
    """Process CPU time of the outermost calls of a few functions of one fxamp package."""

    WATCHED = [("rewriter.pipeline", "trace_model", "trace (front end)"),
               ("frontends.aten", "_export", "  torch.export + unlift"),
               ("rewriter.pipeline", "annotate_step", "annotate runs"),
               ("passes.annotate", "FakeSession.__init__", "  fake session"),
               ("passes.observe", "observe", "  autocast oracle"),
               ("passes.annotate", "_Simulator._run", "  node fake runs"),
               ("passes.norm_eps", "_probe_finite", "norm eps probes"),
               ("rewriter.pass_list", "insert_casts", "insert casts"),
               ("rewriter.pipeline", "ModelState", "model state snapshots")]

    def __init__(self, package: str) -> None:
        self.times: Dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.depth: collections.Counter = collections.Counter()
        for module, qual, label in self.WATCHED:
            try:
                owner: Any = importlib.import_module(f"{package}.{module}")
                *path, attr = qual.split(".")
                for part in path:
                    owner = getattr(owner, part)
                setattr(owner, attr, self._wrap(getattr(owner, attr), label))
            except (ImportError, AttributeError):
                continue  # not in this version

    def _wrap(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth[label] += 1
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth[label] -= 1
                if not self.depth[label]:
                    self.times[label] += time.process_time() - start
                    self.calls[label] += 1
        return timed

    def reset(self) -> None:
        self.times.clear()
        self.calls.clear()


def _unnumbered(plan: str) -> str:
    return re.sub(r"_tensor_constant\d+", "_tensor_constantN", plan)


def clear_caches(pkg: Any) -> None:
    """Empty the caches one fxamp keeps across rewrites (where this version has them)."""
    pkg.passes.observe.CACHE.entries.clear()
    probed = getattr(importlib.import_module(f"{pkg.__name__}.passes.norm_eps"), "_PROBED", None)
    if probed is not None:
        probed.clear()


def plain_s(frontend: str, model: torch.nn.Module, args: tuple, kwargs: dict) -> float:
    """CPU seconds of the front end's own static trace of ``model``."""
    start = time.process_time()
    if frontend == "fx":
        torch.fx.symbolic_trace(model)
    else:
        torch.export.export(model, args, kwargs, strict=False)
    return time.process_time() - start


def fake_run_s(frontend: str, model: torch.nn.Module, args: tuple, kwargs: dict) -> float:
    """CPU seconds of one bare FakeTensor run of the front end's plain graph (fx's
    ``FakeTensorProp``: every node once, no autocast, no decisions): the least a rewrite
    that learns each node's dtype by running the graph on fake tensors can cost."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    if frontend == "fx":
        gm = torch.fx.symbolic_trace(model)
        inputs = list(args)
    else:
        program = torch.export.export(model, args, kwargs, strict=False)
        gm = program.module()
        inputs = [v for v in torch.utils._pytree.tree_leaves((args, kwargs))]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    start = time.process_time()
    with mode:
        fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in inputs]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", required=True,
                    help="the src/ folder of the other fxamp checkout (e.g. a git worktree "
                         "of an older commit)")
    ap.add_argument("--models", default=MODELS, help="comma-separated; default %(default)s")
    ap.add_argument("--configs", default="bf16/cpu,fp16/cuda")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--phases", action="store_true",
                    help="print each version's last rewrite split by phase")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    a = ap.parse_args()
    import fxamp as after
    before = load_as(a.before_src, "fxamp_before")
    for name in ("fxamp", "fxamp_before"):  # (side-effect reports: one per rewrite)
        logging.getLogger(name).setLevel(logging.ERROR)
    phases = ({"before": Phases("fxamp_before"), "after": Phases("fxamp")} if a.phases
              else {})
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    warm = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for pkg in (before, after):  # imports and first-call costs out of the way
        pkg.amp_rewrite(warm, (torch.randn(2, 4),),
                        pkg.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    rows: List[List[Any]] = []
    for key in filter(None, a.models.split(",")):
        model, args, kwargs = build(key)
        warmed = False
        for conf in a.configs.split(","):
            dtype, target = dtypes[conf.split("/")[0]], conf.split("/")[1]
            times: Dict[str, List[float]] = {"plain": [], "before": [], "after": []}
            plans = {}
            frontend = ""
            for rep in range(a.repeat):
                for label, pkg in (("before", before), ("after", after)):
                    clear_caches(pkg)
                    gc.collect()  # every rewrite starts from a clean heap (untimed)
                    if label in phases:
                        phases[label].reset()
                    start = time.process_time()
                    gm = pkg.amp_rewrite(model, args,
                                         pkg.RewriteConfig.make(example_kwargs=kwargs, dtype=dtype,
                                                                target=target))
                    times[label].append(time.process_time() - start)
                    if rep == 0:  # (fx's own trace below may rename tensor constants)
                        plans[label] = str(pkg.plan_of(gm))
                    frontend = pkg.plan_of(gm).header.get("frontend", "?")
                if not warmed:  # the first trace of a model pays one-off costs
                    plain_s(frontend, model, args, kwargs)
                    warmed = True
                gc.collect()
                times["plain"].append(plain_s(frontend, model, args, kwargs))
            try:
                fake = f"{fake_run_s(frontend, model, args, kwargs):.2f}"
            except Exception as err:  # noqa: BLE001 - a column left empty, said why
                fake = f"({type(err).__name__})"
            med = {k: statistics.median(v) for k, v in times.items()}
            # a plain fx trace of some models (timm Swin) shifts the numbering of the tensor
            # constants fx names in a later trace: names only, compared apart
            same = ("same" if plans["before"] == plans["after"] else
                    "same but constant names" if _unnumbered(plans["before"])
                    == _unnumbered(plans["after"]) else "PLAN DIFFERS")
            rows.append([key, conf, frontend, f"{med['plain']:.2f}", fake,
                         f"{med['before']:.2f}",
                         f"{med['after']:.2f}", f"{med['before'] / med['plain']:.1f}",
                         f"{med['after'] / med['plain']:.1f}",
                         f"{med['after'] / med['before']:.2f}", same])
            print(rows[-1], flush=True)
            for which, watched in phases.items():  # the last rewrite of each
                total = times[which][-1]
                print(f"  {which}: {total:.2f} s", flush=True)
                for label, secs in sorted(watched.times.items(), key=lambda kv: -kv[1]):
                    print(f"    {label:28s} {secs:6.2f} s {100 * secs / total:5.1f}% "
                          f"({watched.calls[label]} calls)", flush=True)
    text = _common.table(["model", "dtype/target", "front end", "plain trace CPU s",
                          "bare fake run CPU s", "before CPU s", "after CPU s",
                          "before/plain", "after/plain", "after/before", "plans"], rows)
    print(text)
    load = os.getloadavg()
    note = (f"Load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
            f"({os.cpu_count()} logical cores).")
    print(note)
    if a.write:
        _common.append_docs("amp_rewrite time before/after", text, note)


if __name__ == "__main__":
    main()
