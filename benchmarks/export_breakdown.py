"""Where the time of fxamp's rewrite + ONNX export goes, against one FP32 ONNX export.

Per model of ``_export_models`` (the rows of ``export_peers.py``): the FP32 export
(``torch.onnx.export(dynamo=True)``) and fxamp's ``amp_rewrite(model, x, "tensorrt")`` +
``export_onnx``, interleaved ``--rounds`` times, in process CPU time (the machine may be shared:
CPU time is what this process spent, whatever else runs; a full garbage collection before each
run, so that each pays the collections its own objects cause, not the previous run's: fxamp's
rewrite and export freeze the older objects, which moves a collection they would pay to the
next run). fxamp's time is split by timing the
functions it passes through: the plan's capture (``frontends.aten.export_trace``, all its
``torch.export`` calls), the calibration run of a deployment plan, every ``torch.export``
call (the plan's and the ONNX exporter's), building the ``ExportedProgram`` from the planned
graph, the ONNX exporter's registry, decompositions and translation, fxamp's folds and its
check of the file, and the full (oldest-generation) garbage collections that ran during it.
Medians of the rounds.

    python benchmarks/export_breakdown.py --models distilbert_pad,bert_tiny,resnet18
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import io
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _export_models import MODELS  # noqa: E402

import fxamp  # noqa: E402

SPENT: Dict[str, float] = collections.defaultdict(float)

#: (module, function, column): the functions timed inside fxamp's rewrite + export
STAGES = [
    ("fxamp.frontends.aten", "export_trace", "plan capture"),
    ("fxamp.passes.ranges", "collect_ranges", "calibration"),
    ("torch.export", "export", "torch.export (all)"),
    ("fxamp.export.onnx_export", "exported_program", "build program"),
    ("torch.onnx._internal.exporter._core", "_prepare_exported_program_for_export",
     "ONNX decompositions"),
    ("torch.onnx._internal.exporter._core", "_exported_program_to_onnx_program",
     "ONNX translation"),
    ("fxamp.export.onnx_export", "_fold_and_optimize", "folds + optimizer"),
    ("fxamp.export.onnx_export", "run_onnx_steps", "ONNX steps (folds, optimizer)"),
    ("fxamp.export.onnx_export", "check_export", "check of the file"),
]
#: the check of the written file against PyTorch (onnxruntime and true FP16), which the FP32
#: export does not do: the ratio is given without it too
CHECK = "check of the file"


def _timed(fn: Callable, column: str) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[column] += time.process_time() - start
    return run


def _full_collections(phase: str, info: Dict[str, Any]) -> None:
    """A ``gc.callbacks`` hook adding the time of each full (oldest-generation) collection."""
    if info["generation"] != 2:
        return
    if phase == "start":
        SPENT["_gc_start"] = time.process_time()
    else:
        SPENT["full GC"] += time.process_time() - SPENT.pop("_gc_start", time.process_time())


def _install() -> List[str]:
    import importlib

    from torch.onnx._internal.exporter import _registration

    columns = []
    for module_name, name, column in STAGES:
        module = importlib.import_module(module_name)
        if hasattr(module, name):  # (build program: not on every version)
            setattr(module, name, _timed(getattr(module, name), column))
            columns.append(column)
    registry = _registration.ONNXRegistry.from_torchlib
    timed_registry = _timed(registry, "ONNX registry")
    _registration.ONNXRegistry.from_torchlib = classmethod(
        lambda cls, *a, **k: timed_registry(*a, **k))
    gc.callbacks.append(_full_collections)
    return columns + ["ONNX registry", "full GC"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="distilbert_pad,bert_tiny,t5_enc_pad,vit_tiny,resnet18",
                    help="comma-separated, from: " + ", ".join(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    columns = _install()
    from fxamp.export import export_onnx

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            model, inputs, _ = MODELS[name]()

            def fp32() -> None:
                with contextlib.redirect_stdout(io.StringIO()):
                    torch.onnx.export(model, inputs, os.path.join(tmp, "a.onnx"), dynamo=True)

            def fx() -> None:
                gm = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(target="tensorrt"))
                export_onnx(gm, inputs, os.path.join(tmp, "b.onnx"))

            fp32()
            fx()  # (one-time setup paid before the timed rounds)
            got: Dict[str, List[float]] = collections.defaultdict(list)
            for _ in range(max(1, a.rounds)):
                gc.collect()  # (each run pays the collections its own objects cause)
                SPENT.clear()
                start = time.process_time()
                fp32()
                got["FP32 export"].append(time.process_time() - start)
                got["FP32 full GC"].append(SPENT.get("full GC", 0.0))
                gc.collect()
                SPENT.clear()
                start = time.process_time()
                fx()
                got["fxamp"].append(time.process_time() - start)
                for column in columns:
                    got[column].append(SPENT.get(column, 0.0))
            med = {k: statistics.median(v) for k, v in got.items()}
            rows.append([name, f"{med['FP32 export']:.2f}", f"{med['fxamp']:.2f}",
                         f"{med['fxamp'] / med['FP32 export']:.2f}x",
                         f"{(med['fxamp'] - med[CHECK]) / med['FP32 export']:.2f}x"]
                        + [f"{med[c]:.2f}" for c in columns] + [f"{med['FP32 full GC']:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    md = _common.table(["model", "FP32 export s", "fxamp rewrite + export s", "ratio",
                        "ratio without the check of the file"]
                       + [f"{c} s" for c in columns] + ["FP32 export's full GC s"], rows)
    print(md)
    if not a.no_docs:
        _common.append_docs(
            "Rewrite + ONNX export: where the time goes",
            "Process CPU time, 1 torch thread, medians of "
            f"{a.rounds} interleaved rounds of the FP32 export and fxamp's rewrite "
            "(`target=\"tensorrt\"`) + `export_onnx`. The stage columns are parts of fxamp's "
            "time (torch.export (all) overlaps plan capture; the ONNX columns are what the FP32 "
            "export spends too).\n\n" + md)


if __name__ == "__main__":
    main()
