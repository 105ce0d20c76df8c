"""FP16 ONNX for deployment: fxamp (``target="tensorrt"``) against ModelOpt ONNX AutoCast and
onnxconverter-common, on the same small models.

Each model is exported once to FP32 ONNX (``torch.onnx.export(dynamo=True)``, timed); the
peers convert that file in their own environment (``--peer-python``, a python where
``nvidia-modelopt[onnx]`` and ``onnxconverter-common`` are installed: ModelOpt pulls
``onnxruntime-gpu``, which overwrites ``onnxruntime``, so keep them apart); fxamp rewrites the
PyTorch model and exports it. A peer that is not installed is skipped with a line saying so.

Per model and tool: whether it converted, whether onnxruntime loads the file, the max abs
error against FP32 PyTorch on a second input (onnxruntime CPU, which runs most FP16 nodes in
FP32, and ``onnx.reference``, every op in its declared type: true FP16), the FP16 share of
the compute nodes, the Casts, BatchNormalization nodes left, and the conversion time (fxamp:
rewrite + export; a peer: the FP32 export + its conversion). The goal rows compare fxamp with
the peers model by model.

    python benchmarks/export_peers.py --peer-python PATH_TO_PEER_VENV/bin/python
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _export_models import MODELS  # noqa: E402

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
        gm = fxamp.amp_rewrite(model, inputs, target="tensorrt")
        mid = time.perf_counter()
        export_onnx(gm, inputs, path)
    except fxamp.FxampError as err:
        return {"ok": False, "error": str(err).splitlines()[0]}
    end = time.perf_counter()
    return {"ok": True, "seconds": end - start,
            "split": f"rewrite {mid - start:.1f} + export {end - mid:.1f}"}


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


def measure(path: str, feed: Dict[str, np.ndarray], want: np.ndarray) -> Dict[str, Any]:
    """Loads / errors / FP16 share / Casts / BatchNorms of one ONNX file."""
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

    def err(got: Any) -> float:
        got = np.asarray(got, dtype=np.float64)
        if got.shape != want.shape or not np.isfinite(got).all():
            return float("nan")
        return float(np.abs(got - want).max())
    try:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        out["loads"] = "yes"
        out["ort"] = err(sess.run(None, feed)[0])
    except Exception as e:  # noqa: BLE001 - a file onnxruntime refuses is a result
        out["loads"] = f"no ({type(e).__name__})"
        out["ort"] = float("nan")
    try:
        out["fp16"] = err(run_true_fp16(proto, feed)[0])
    except Exception as e:  # noqa: BLE001
        out["fp16"] = float("nan")
        out["fp16_error"] = type(e).__name__
    return out


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return "NaN" if v != v else f"{v:.2g}"


def _goals(name: str, res: Dict[str, Dict[str, Any]]) -> List[str]:
    """The goal checks for one model: fxamp against the peers."""
    fx, mo = res.get("fxamp", {}), res.get("modelopt", {})
    peers = [res[t] for t in ("modelopt", "occ") if res.get(t, {}).get("ok")]
    if not fx.get("ok"):
        return [name, "fxamp failed"] + ["-"] * 5
    finite = [p["fp16"] for p in peers if p.get("fp16") == p.get("fp16")]
    best = min(finite) if finite else None
    e = fx["fp16"]
    if all(res.get(t, {}).get("missing") for t in ("modelopt", "occ")):
        err_goal = "- (no peer ran)"
    elif best is None:
        err_goal = "yes (every peer fails)" if e == e else "no"
    else:
        ok = e == e and e <= 1.1 * best + 1e-12
        err_goal = f"{'yes' if ok else 'no'} ({_fmt(e)} vs {_fmt(best)})"
    if mo.get("ok"):
        casts = (f"{'yes' if fx['casts'] <= mo['casts'] + 2 else 'no'} "
                 f"({fx['casts']} vs {mo['casts']})")
        a, b = (int(x) for x in fx["share"].split("/"))
        c, d = (int(x) for x in mo["share"].split("/"))
        share = f"{'yes' if a / b >= c / d - 1e-9 else 'no'} ({a / b:.0%} vs {c / d:.0%})"
        t = (f"{'yes' if fx['total'] <= 1.5 * mo['total'] else 'no'} "
             f"({fx['total']:.1f} vs {mo['total']:.1f} s)")
    else:
        casts = share = t = "- (ModelOpt not run)"
    return [name, err_goal, casts, share, "yes" if fx["bn"] == 0 else f"no ({fx['bn']})", t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", default=os.environ.get("FXAMP_PEER_PYTHON", ""),
                    help="python of the environment with the peers (env FXAMP_PEER_PYTHON); "
                    "none: the peers are skipped")
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated, from: " + ", ".join(MODELS))
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows, goals, versions = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            model, inputs, check = MODELS[name]()
            with torch.no_grad():
                want = model(*check).detach().double().numpy()
            feed_names = None
            fp32 = os.path.join(tmp, f"{name}.fp32.onnx")
            t_fp32 = export_fp32(model, inputs, fp32)
            res: Dict[str, Dict[str, Any]] = {}
            for tool in TOOLS:
                dst = os.path.join(tmp, f"{name}.{tool}.onnx")
                if tool == "fxamp":
                    r = run_fxamp(model, inputs, dst)
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
                    feed = {n: t.numpy() for n, t in zip(feed_names, check)}
                    r.update(measure(dst, feed, want))
                res[tool] = r
                status = ("yes" if r.get("ok") else
                          "skipped" if r.get("missing") else f"no: {r.get('error', '?')[:90]}")
                rows.append([name, LABEL[tool], status, r.get("loads", "-"),
                             _fmt(r.get("ort")), _fmt(r.get("fp16")), r.get("share", "-"),
                             r.get("casts", "-"), r.get("bn", "-"),
                             f"{r['total']:.1f} ({r['split']})" if r.get("total") else "-"])
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
            goals.append(_goals(name, res))
    md = _common.table(["model", "tool", "converted", "loads in onnxruntime",
                        "max abs error, onnxruntime CPU", "max abs error, true FP16",
                        "FP16 share (compute nodes)", "Casts", "BatchNormalization",
                        "conversion s"], rows)
    md_goal = _common.table(["model", "true-FP16 error <= 1.1x best peer",
                             "Casts <= ModelOpt + 2",
                             "FP16 share >= ModelOpt", "no BatchNormalization",
                             "time <= 1.5x ModelOpt (incl. FP32 export)"], goals)
    print(md)
    print()
    print(md_goal)
    if not a.no_docs:
        vers = ", ".join(f"{LABEL[k]} {v}" for k, v in sorted(versions.items())) or "none"
        body = (f"Peers: {vers}; onnx, onnxruntime CPU. Errors are max abs differences from "
                "FP32 PyTorch on a second input (NaN: not finite). Times: one run, wall "
                "clock, 1 torch thread; the first export of the process (the FP32 one) pays "
                "the exporter's one-time setup (peers: the FP32 export in this process + "
                "their conversion call, without their import).\n\n"
                f"{md}\n\nGoals, per model:\n\n{md_goal}")
        _common.append_docs("FP16 ONNX for deployment: fxamp vs ModelOpt AutoCast and "
                            "onnxconverter-common", body)


if __name__ == "__main__":
    main()
