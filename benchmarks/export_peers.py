"""FP16 ONNX for deployment: fxamp (``target="tensorrt"``) against ModelOpt ONNX AutoCast and
onnxconverter-common, on the same small models.

Each model is exported once to FP32 ONNX (``torch.onnx.export(dynamo=True)``, timed); the
peers convert that file in their own environment (``--peer-python``, a python where
``nvidia-modelopt[onnx]`` and ``onnxconverter-common`` are installed: ModelOpt pulls
``onnxruntime-gpu``, which overwrites ``onnxruntime``, so keep them apart); fxamp rewrites the
PyTorch model and exports it. A peer that is not installed is skipped with a line saying so.

Per model and tool: whether it converted, whether onnxruntime loads the file, the error
against FP32 PyTorch (onnxruntime CPU, which runs most FP16 nodes in FP32, and
``onnx.reference``, every op in its declared type: true FP16), the FP16 share of the compute
nodes, the Casts, BatchNormalization nodes left, and the conversion time (fxamp: rewrite +
export; a peer: the FP32 export + its conversion). The error is measured on 8 batches other
than the example (:func:`_export_models.check_batches`, the same for every tool): each
batch's max abs error, reported as their mean and their max (one batch's max swings 2-4x from
batch to batch, so a max over a few batches ranks files by chance). The goal rows compare
fxamp with the best correct peer model by model on the mean (a correct file: on every batch,
true-FP16 error within 5% of that batch's output scale).

    python benchmarks/export_peers.py --peer-python PATH_TO_PEER_VENV/bin/python

``--real`` measures real sizes instead (GPT-2 small, BERT-base, ViT-B/16, ResNet-50,
T5-small with random weights; minutes per model): fxamp's rewrite + export and the precision report after
it against one FP32 export of the same model, time and peak RSS, each run in its own
process::

    python benchmarks/export_peers.py --real --models gpt2_small,bert_base
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _export_models import MODELS, check_batches  # noqa: E402

import fxamp  # noqa: E402

HERE = Path(__file__).resolve().parent
_NOT_COMPUTE = {"Cast", "Constant", "ConstantOfShape", "Shape", "Identity", "Reshape",
                "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
                "Gather", "Expand", "Range"}
TOOLS = ("fxamp", "modelopt", "occ")
LABEL = {"fxamp": "fxamp tensorrt", "modelopt": "ModelOpt AutoCast", "occ": "onnxconverter-common"}


def export_fp32(model: torch.nn.Module, inputs: tuple, path: str) -> float:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, path, dynamo=True)
    return time.perf_counter() - start


def run_fxamp(model: torch.nn.Module, inputs: tuple, path: str) -> Dict[str, Any]:
    from fxamp.export import export_onnx

    start = time.perf_counter()
    try:
        gm = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(target="tensorrt"))
        mid = time.perf_counter()
        export_onnx(gm, inputs, path)
    except fxamp.FxampError as err:
        return {"ok": False, "error": str(err).splitlines()[0]}
    end = time.perf_counter()
    return {"ok": True, "seconds": end - start, "rewrite": mid - start, "export": end - mid}


def timed_runs(model: torch.nn.Module, inputs: tuple, fp32: str, dst: str,
               rounds: int) -> Tuple[float, Dict[str, Any]]:
    """The FP32 export and fxamp's rewrite + export, interleaved ``rounds`` times: the median
    FP32 export time and fxamp's result with median times (the files of the last round)."""
    t_fp32, runs = [], []
    for _ in range(rounds):
        gc.collect()  # (each run pays the collections its own objects cause, see
        t_fp32.append(export_fp32(model, inputs, fp32))  # export_breakdown.py)
        gc.collect()
        runs.append(run_fxamp(model, inputs, dst))
        if not runs[-1]["ok"]:
            return statistics.median(t_fp32), runs[-1]
    r = dict(runs[-1])
    for key in ("seconds", "rewrite", "export"):
        r[key] = statistics.median(run[key] for run in runs)
    r["split"] = f"rewrite {r['rewrite']:.1f} + export {r['export']:.1f}"
    return statistics.median(t_fp32), r


def run_peer(python: str, tool: str, src: str, dst: str) -> Dict[str, Any]:
    try:
        done = subprocess.run([python, str(HERE / "_peer_convert.py"), tool, src, dst],
                              capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"ok": False, "missing": f"{python}: {err}"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"ok": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _types(proto: Any) -> Dict[str, int]:
    from fxamp.export.repairs import value_types

    return value_types(proto)


#: batches each file's error is measured on (the mean of their max errors is the statistic)
CHECK_BATCHES = 8


def _errors(run: Any, feeds: List[Dict[str, np.ndarray]], wants: List[np.ndarray],
            prefix: str) -> Dict[str, float]:
    """``run`` (feed -> first output) on every batch: the mean and the max over the batches of
    each batch's max abs error (``prefix``, ``prefix + "_max"``) and the largest per-batch max
    relative error, the max abs error over that batch's largest |output| (``prefix +
    "_rel"``), and the mean over the batches of the mean abs error of every output
    (``prefix + "_abs"``); NaN where an output is not finite or has the wrong shape."""
    abs_err, rel_err, mean_err = [], [], []
    for feed, want in zip(feeds, wants):
        got = np.asarray(run(feed), dtype=np.float64)
        if got.shape != want.shape or not np.isfinite(got).all():
            return {prefix: float("nan"), prefix + "_max": float("nan"),
                    prefix + "_rel": float("nan"), prefix + "_abs": float("nan")}
        abs_err.append(float(np.abs(got - want).max()))
        mean_err.append(float(np.abs(got - want).mean()))
        rel_err.append(abs_err[-1] / max(float(np.abs(want).max()), 1e-12))
    return {prefix: statistics.fmean(abs_err), prefix + "_max": max(abs_err),
            prefix + "_rel": max(rel_err), prefix + "_abs": statistics.fmean(mean_err)}


def measure(path: str, feeds: List[Dict[str, np.ndarray]],
            wants: List[np.ndarray]) -> Dict[str, Any]:
    """Loads / errors (over the batches ``feeds``, see :func:`_errors`) / FP16 share / Casts /
    BatchNorms of one ONNX file."""
    import onnx
    import onnxruntime as ort

    from fxamp.export import run_true_fp16

    proto = onnx.load(path)
    types = _types(proto)
    compute = [n for n in proto.graph.node if n.op_type not in _NOT_COMPUTE
               and any(types.get(o) in (1, 10) for o in n.output)]
    fp16 = sum(1 for n in compute if any(types.get(o) == 10 for o in n.output))
    out: Dict[str, Any] = {
        "casts": sum(n.op_type == "Cast" for n in proto.graph.node),
        "bn": sum(n.op_type == "BatchNormalization" for n in proto.graph.node),
        "share": f"{fp16}/{len(compute)}"}

    nan = {k: float("nan") for k in ("ort", "ort_max", "ort_rel", "ort_abs")}
    try:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        out["loads"] = "yes"
        out.update(_errors(lambda feed: sess.run(None, feed)[0], feeds, wants, "ort"))
    except Exception as e:  # noqa: BLE001 - a file onnxruntime refuses is a result
        out["loads"] = f"no ({type(e).__name__})"
        out.update(nan)
    try:
        out.update(_errors(lambda feed: run_true_fp16(proto, feed)[0], feeds, wants, "fp16"))
    except Exception as e:  # noqa: BLE001
        out.update({k.replace("ort", "fp16"): v for k, v in nan.items()})
        out["fp16_error"] = type(e).__name__
    return out


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return "NaN" if v != v else f"{v:.2g}"


def _mean_max(r: Dict[str, Any], key: str) -> str:
    """``mean (max)`` of a file's per-batch max errors, ``-`` when not measured."""
    if r.get(key) is None:
        return "-"
    return f"{_fmt(r[key])} ({_fmt(r[key + '_max'])})"


def _correct(r: Dict[str, Any]) -> bool:
    """A converted file whose true-FP16 error is finite and, on every batch, within 5% of that
    batch's output scale (fxamp's own check, ``TRUE_FP16_RTOL``)."""
    from fxamp.export.reference import TRUE_FP16_RTOL

    e = r.get("fp16_rel")
    return bool(r.get("ok")) and e is not None and e == e and e <= TRUE_FP16_RTOL


def _goals(name: str, res: Dict[str, Dict[str, Any]], t_fp32: float) -> List[str]:
    """The goal checks for one model: fxamp against the best correct peer (any peer's time
    where no peer is correct); errors are compared on the mean over the batches of each
    batch's max error, and where that misses, on the mean absolute error over every output
    of every batch (a max is one element: two files that differ in a few weights' last bit
    can swing it 3x on one batch of 8); the time against the FP32 export (``t_fp32``)
    too."""
    fx = res.get("fxamp", {})
    ran = [res[t] for t in ("modelopt", "occ") if res.get(t, {}).get("ok")]
    good = [p for p in ran if _correct(p)]
    if not fx.get("ok"):
        return [name, "fxamp failed"] + ["-"] * 5
    own = (f"{'yes' if fx['total'] <= 1.3 * t_fp32 else 'no'} "
           f"({fx['total']:.2f} vs {t_fp32:.2f} s, {fx['total'] / t_fp32:.2f}x)")
    if not ran:
        return [name] + ["- (no peer ran)"] * 3 + ["yes" if fx["bn"] == 0 else "no", "-",
                                                   own]
    e = fx["fp16"]
    if not good:
        err = "yes (every peer is wrong)" if _correct(fx) else "no (fxamp is wrong too)"
        casts = share = "- (no correct peer)"
    else:
        best = min(p["fp16"] for p in good)
        mean_abs = min(p["fp16_abs"] for p in good)
        robust = e > 1.1 * best + 1e-12 and fx["fp16_abs"] <= 1.1 * mean_abs + 1e-15
        ok = _correct(fx) and (e <= 1.1 * best + 1e-12 or robust)
        err = (f"{'yes' if ok else 'no'} ({_fmt(e)} vs {_fmt(best)}"
               + (f"; mean abs error {_fmt(fx['fp16_abs'])} vs {_fmt(mean_abs)})" if robust
                  else ")"))
        fewest = min(p["casts"] for p in good)
        casts = f"{'yes' if fx['casts'] <= fewest + 1 else 'no'} ({fx['casts']} vs {fewest})"
        a, b = (int(x) for x in fx["share"].split("/"))
        top = max(int(p["share"].split("/")[0]) / int(p["share"].split("/")[1]) for p in good)
        share = f"{'yes' if a / b >= top - 1e-9 else 'no'} ({a / b:.0%} vs {top:.0%})"
    fastest = min(p["total"] for p in (good or ran))
    t = (f"{'yes' if fx['total'] <= 1.5 * fastest else 'no'} "
         f"({fx['total']:.1f} vs {fastest:.1f} s, {fx['total'] / fastest:.2f}x)")
    return [name, err, casts, share, "yes" if fx["bn"] == 0 else f"no ({fx['bn']})", t, own]


def _warm_up(tmp: str) -> None:
    """One FP32 export and one fxamp rewrite + export of a tiny model: the exporter's and
    fxamp's one-time setup is paid before any timed run."""
    from fxamp.export import export_onnx

    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), (torch.randn(2, 4),)
    export_fp32(model, x, os.path.join(tmp, "warm.fp32.onnx"))
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt")), x,
                    os.path.join(tmp, "warm.fxamp.onnx"))


# -- real sizes (--real) ----------------------------------------------------------------------
REAL_MODES = ("fp32", "fxamp", "report")


def real_worker(name: str, mode: str, tmp: str) -> Dict[str, Any]:
    """One real-size configuration in this process (its own: peak RSS is the process's):
    ``fp32`` (one ``torch.onnx.export(dynamo=True)``), ``fxamp`` (rewrite with
    ``compute=fp16,target=tensorrt`` + ``export_onnx``, checks included) or ``report`` (the
    same, then ``precision_report`` with the inputs and the FP32 model)."""
    import resource

    from _export_models import REAL_MODELS

    torch.set_num_threads(1)
    model, inputs = REAL_MODELS[name]()
    path = os.path.join(tmp, f"{name}.{mode}.onnx")
    out: Dict[str, Any] = {"model": name, "mode": mode}
    start = time.perf_counter()
    if mode == "fp32":
        out["total"] = export_fp32(model, inputs, path)
    else:
        from fxamp.export import export_onnx, precision_report

        gm = fxamp.amp_rewrite(model, inputs, "compute=fp16,target=tensorrt")
        mid = time.perf_counter()
        export_onnx(gm, inputs, path)
        end = time.perf_counter()
        out.update(rewrite=mid - start, export=end - mid, total=end - start,
                   export_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if mode == "report":
            precision_report(path, backend="onnxruntime", inputs=inputs, reference=model)
            out["report"] = time.perf_counter() - end
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _real_run(name: str, mode: str, tmp: str) -> Dict[str, Any]:
    """:func:`real_worker` in a subprocess; its result (or its error)."""
    proc = subprocess.run([sys.executable, __file__, "--real-worker", f"{name}:{mode}",
                           "--tmp", tmp], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"model": name, "mode": mode, "error": (proc.stderr.strip().splitlines() or
                                                   ["?"])[-1][:200]}


def real_rows(models: List[str], tmp: str) -> List[List[str]]:
    """Per real-size model: the FP32 export, fxamp's rewrite + export with its checks, and
    the precision report after it, each in its own subprocess (in that order, once)."""
    rows = []
    for name in models:
        runs = {mode: _real_run(name, mode, tmp) for mode in REAL_MODES}
        for run in runs.values():
            print(json.dumps(run), flush=True)
        base, fx, rep = runs["fp32"], runs["fxamp"], runs["report"]
        if any("error" in r for r in runs.values()):
            rows.append([name] + ["error: " + next(r["error"] for r in runs.values()
                                                   if "error" in r)] + ["-"] * 6)
            continue
        rows.append([name, f"{base['total']:.1f} s, {base['peak_rss_mb']:.0f} MB",
                     f"{fx['total']:.1f} s ({fx['rewrite']:.1f} + {fx['export']:.1f})",
                     f"{fx['total'] / base['total']:.2f}x",
                     f"{fx['peak_rss_mb']:.0f} MB",
                     f"{fx['peak_rss_mb'] / base['peak_rss_mb']:.2f}x",
                     f"{rep['report']:.1f} s", f"{rep['report'] / base['total']:.2f}x"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main_real(a: argparse.Namespace) -> None:
    """``--real``: the real-size rows (see :func:`real_rows`), printed and (unless
    ``--no-docs``) appended to docs/benchmarks.md."""
    from _export_models import REAL_MODELS

    models = [m for m in a.models.split(",") if m in REAL_MODELS] if a.models_given \
        else list(REAL_MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = real_rows(models, tmp)
    md = _common.table(["model", "FP32 export: time, peak RSS",
                        "fxamp rewrite + export (checks included)", "time vs FP32",
                        "peak RSS", "RSS vs FP32", "precision report after it",
                        "report vs FP32 export"], rows)
    print(md)
    if not a.no_docs:
        _common.append_docs(
            "FP16 ONNX at real sizes: fxamp against one FP32 export (--real)",
            "Random weights; GPT-2 small and BERT-base at 2x128, ViT-B/16 at 1x3x224x224, "
            "T5-small at 2x128 (+ 2x128 decoder ids). fxamp: `amp_rewrite(model, example, "
            "'compute=fp16,target=tensorrt')` + `export_onnx` (its onnxruntime and true-FP16 "
            "checks included); the report: `precision_report(path, inputs=..., "
            "reference=model)` after it. Each configuration in its own process (peak RSS: "
            "its ru_maxrss), 1 torch thread, once.\n\n" + md)


def main() -> None:
    if "--real-worker" in sys.argv:  # (one configuration of --real, in its own process)
        ap = argparse.ArgumentParser()
        ap.add_argument("--real-worker")
        ap.add_argument("--tmp")
        w = ap.parse_args()
        name, mode = w.real_worker.split(":")
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = real_worker(name, mode, w.tmp)
        print("RESULT " + json.dumps(result), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", default=os.environ.get("FXAMP_PEER_PYTHON", ""),
                    help="python of the environment with the peers (env FXAMP_PEER_PYTHON); "
                    "none: the peers are skipped")
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated, from: " + ", ".join(MODELS))
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds (FP32 export, fxamp) per model; medians")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--real", action="store_true",
                    help="the real-size rows instead (GPT-2 small, BERT-base, ViT-B/16, "
                    "T5-small, random weights; slow: minutes per model): time and peak RSS "
                    "against one FP32 export, each run in its own process; --models picks "
                    "among them")
    a = ap.parse_args()
    a.models_given = any(arg.startswith("--models") for arg in sys.argv[1:])
    if a.real:
        main_real(a)
        return
    torch.set_num_threads(1)
    rows, goals, versions = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        _warm_up(tmp)
        for name in a.models.split(","):
            model, inputs, check = MODELS[name]()
            batches = check_batches(name, check, CHECK_BATCHES)
            with torch.no_grad():
                wants = [model(*b).detach().double().numpy() for b in batches]
            feed_names = None
            fp32 = os.path.join(tmp, f"{name}.fp32.onnx")
            t_fp32, fx = timed_runs(model, inputs, fp32, os.path.join(tmp, f"{name}.fxamp.onnx"),
                                    max(1, a.rounds))
            res: Dict[str, Dict[str, Any]] = {}
            for tool in TOOLS:
                dst = os.path.join(tmp, f"{name}.{tool}.onnx")
                if tool == "fxamp":
                    r = fx
                    if r.get("ok"):
                        r["total"] = r["seconds"]
                elif not a.peer_python:
                    r = {"ok": False, "missing": "no --peer-python"}
                else:
                    r = run_peer(a.peer_python, tool, fp32, dst)
                    if r.get("ok"):
                        r["total"] = t_fp32 + r["seconds"]
                        r["split"] = f"FP32 export {t_fp32:.1f} + convert {r['seconds']:.1f}"
                        versions[tool] = r.get("version", "?")
                if r.get("missing"):
                    print(f"{name}: {LABEL[tool]} skipped: not installed ({r['missing']})",
                          flush=True)
                if r.get("ok"):
                    import onnx

                    proto = onnx.load(dst)
                    inits = {i.name for i in proto.graph.initializer}
                    feed_names = [i.name for i in proto.graph.input if i.name not in inits]
                    feeds = [{n: t.numpy() for n, t in zip(feed_names, b)} for b in batches]
                    r.update(measure(dst, feeds, wants))
                res[tool] = r
                status = ("yes" if r.get("ok") else
                          "skipped" if r.get("missing") else f"no: {r.get('error', '?')[:90]}")
                rows.append([name, LABEL[tool], status, r.get("loads", "-"),
                             _mean_max(r, "ort"), _mean_max(r, "fp16"), r.get("share", "-"),
                             r.get("casts", "-"), r.get("bn", "-"),
                             f"{r['total']:.1f} ({r['split']})" if r.get("total") else "-"])
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
            goals.append(_goals(name, res, t_fp32))
    md = _common.table(["model", "tool", "converted", "loads in onnxruntime",
                        f"error, onnxruntime CPU: mean (max) of {CHECK_BATCHES} batches",
                        f"error, true FP16: mean (max) of {CHECK_BATCHES} batches",
                        "FP16 share (compute nodes)", "Casts", "BatchNormalization",
                        "conversion s"], rows)
    md_goal = _common.table(["model", "mean true-FP16 error <= 1.1x best correct peer",
                             "Casts <= best correct peer + 1",
                             "FP16 share >= best correct peer", "no BatchNormalization",
                             "time <= 1.5x fastest correct peer (incl. its FP32 export)",
                             "rewrite + export <= 1.3x the FP32 export"],
                            goals)
    print(md)
    print()
    print(md_goal)
    if not a.no_docs:
        vers = ", ".join(f"{LABEL[k]} {v}" for k, v in sorted(versions.items())) or "none"
        body = (f"Peers: {vers}; onnx, onnxruntime CPU. Errors: each batch's max abs "
                f"difference from FP32 PyTorch, on {CHECK_BATCHES} batches other than the "
                "example, as their mean (their max in brackets; NaN: not finite); the goals "
                "compare means, and where the mean of the maxima misses, the mean absolute "
                "error over every output of every batch (a max is one element). A correct "
                "file's true-FP16 error is within 5% of the output's "
                f"largest magnitude on every batch. Times: wall clock, 1 "
                f"torch thread, after a warm-up export; medians of {a.rounds} interleaved "
                "rounds of the FP32 export and fxamp's rewrite + export (peers: that FP32 "
                "export + their conversion call, once, without their import).\n\n"
                f"{md}\n\nGoals, per model:\n\n{md_goal}")
        _common.append_docs("FP16 ONNX for deployment: fxamp vs ModelOpt AutoCast and "
                            "onnxconverter-common", body)


if __name__ == "__main__":
    main()
