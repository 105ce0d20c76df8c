"""precision_report and check_numerics: what an exported model really computes in.

Three views of each ONNX node:

* planned: the fxamp plan's dtype for the fx node the node came from (``fxamp.fx_node``);
* exported: the dtype it computes in inside the ONNX file (ONNX shape inference: the type of
  its first floating input, or of its output for a Cast);
* actual: what the backend runs.

onnxruntime (tested here with CPUExecutionProvider): a session is built with graph
optimizations off and ``optimized_model_filepath`` set, so the saved graph keeps the original
node names but shows the Cast nodes onnxruntime inserts around kernels it lacks in FP16 (named
"InsertedPrecisionFreeCast_..."; onnxruntime then also drops the now-redundant casts of the
model). A node computing in FP32 there but FP16 in the file is a fallback. With session
profiling on, the provider that ran each node is read back; where a GPU provider was asked for,
a node run by the CPU provider is a fallback too.

TensorRT: ``fxamp.export.trt_build.tensorrt_layers`` builds an engine (TensorRT 10/11
Python API; NOT run by fxamp's tests: no TensorRT there) and reads its inspector JSON with
``fxamp.export.trt_layers``, which is tested on NVIDIA's published engine files; an engine
built elsewhere can be read with ``precision_report(..., engine_info=FILE)``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence

from ..plan import Plan
from ..ir import Rule
from ..policy import dtype_name
from .dynamic import AXES_KEY, other_shape, parse_axes, shape_text
from .backends import ONNXRUNTIME, TENSORRT, alias_device, choose
from .onnx_metadata import FX_NODE, MODULE, NOTE, get_meta
from .onnx_types import ONNX_FLOAT_NAMES, compute_dtype
from .ort_layers import feeds, lean_options, providers
from .repairs import value_types
from .errors import NumericsError
from .layers import LayerPrecision
from .verify import input_names
from .report import PrecisionReport
from .trt_layers import apply_engine_info

log = logging.getLogger(__name__)

def _load(path: str) -> Any:
    import onnx

    return onnx.load(path)


def _plan_from(model: Any, plan: Optional[Plan]) -> Optional[Plan]:
    if plan is not None:
        return plan
    for prop in model.metadata_props:
        if prop.key == "fxamp.plan":
            return Plan.from_text(prop.value)
    return None


def _planned(plan: Optional[Plan], fx_node: Optional[str], onnx_node: Any,
             types: Dict[str, int]) -> Optional[str]:
    if plan is None or fx_node is None:
        return None
    p = plan.nodes.get(fx_node)
    if p is None:  # a cast fxamp inserted: "<value>_<dtype>"
        suffix = fx_node.rstrip("_").rpartition("_")[2]
        return suffix if suffix in ("fp16", "bf16", "fp32") else None
    if p.rule == Rule.RUNTIME:  # torch.autocast decides per op inside it: nothing to compare
        return None
    want = p.inputs if p.inputs is not None else p.dtype
    if onnx_node.op_type == "Cast":  # a cast inside the node's lowering: lands on its dtype
        return dtype_name(p.dtype)
    return dtype_name(want)


def _exported_layers(model: Any, plan: Optional[Plan]) -> List[LayerPrecision]:
    types = value_types(model)
    layers = []
    for node in model.graph.node:
        if node.op_type == "Constant":
            continue
        fx_node = get_meta(node, FX_NODE)
        exported = compute_dtype(node, types)
        planned = _planned(plan, fx_node, node, types) if exported is not None else None
        layer = LayerPrecision(onnx_node=node.name, op_type=node.op_type, fx_node=fx_node,
                               module=get_meta(node, MODULE), planned=planned,
                               exported=ONNX_FLOAT_NAMES.get(exported) if exported else None,
                               note=(get_meta(node, NOTE) or "").strip())
        if planned and layer.exported and planned != layer.exported:
            layer.fallback = True
            layer.note = (f"exporter: computes in {layer.exported} in the ONNX file, plan "
                          f"says {planned}. " + layer.note).strip()
        layers.append(layer)
    return layers


def precision_report(path: str, plan: Optional[Plan] = None, backend: str = "auto", *,
                     inputs: Optional[Sequence[Any]] = None, reference: Any = None,
                     device: Optional[str] = None, rtol: float = 1e-2,
                     atol: float = 1e-2, engine_info: Any = None) -> PrecisionReport:
    """Per-layer precision of the ONNX model at ``path`` against ``plan`` on ``backend``.

    Args:
        path: an ONNX file ``export_onnx`` wrote.
        plan: the fxamp Plan (default: the one ``export_onnx`` stored in the file).
        backend: a name of ``fxamp.export.backends.REGISTRY`` (``"onnxruntime"``,
            ``"tensorrt"``) or ``"auto"`` (TensorRT when it imports and a GPU exists);
            ``"onnxruntime-cuda"`` is onnxruntime on its CUDA provider.
        inputs: the example inputs (default: random, dynamic dims 1).
        reference: the FP32 PyTorch model; when given with ``inputs`` the report's
            ``numerics`` holds the per-output errors (without raising; use
            ``check_numerics`` to fail above tolerance).
        device: an onnxruntime provider to ask for (default CUDA when available, else CPU).
        rtol: the relative tolerance of the ``numerics`` rows.
        atol: the absolute tolerance of the ``numerics`` rows.
        engine_info: the inspector JSON of a TensorRT engine built from this file
            elsewhere (path, text or dict; e.g. from ``trtexec --exportLayerInfo``):
            ``actual`` is read from it, nothing is built or run.

    Returns:
        The ``PrecisionReport``: per layer, the planned, exported and actual precision.

    Raises:
        UnknownBackendError: an unknown ``backend``.
        BackendUnavailableError: the backend named is not available (the message says
            what to do).
        OSError: the file cannot be read.
    """
    if engine_info is not None:
        model = _load(path)
        layers = _exported_layers(model, _plan_from(model, plan))
        apply_engine_info(layers, engine_info)
        return PrecisionReport(layers=layers, backend=TENSORRT.name, device="inspector JSON",
                               model=os.path.basename(path),
                               exporter=next((p.value for p in model.metadata_props
                                              if p.key == "fxamp.exporter"), ""))
    chosen = choose(backend)
    device = device or alias_device(backend)
    model = _load(path)
    plan = _plan_from(model, plan)
    exporter = next((p.value for p in model.metadata_props if p.key == "fxamp.exporter"), "")
    layers = _exported_layers(model, plan)
    try:
        used = chosen.run(path, layers, inputs, device)
    except Exception as err:  # noqa: BLE001 - the TensorRT path is unverified here
        if backend != "auto" or chosen is ONNXRUNTIME:
            raise
        log.warning("%s inspection failed (%s); using onnxruntime", chosen.label, err)
        chosen, layers = ONNXRUNTIME, _exported_layers(model, plan)
        used = chosen.run(path, layers, inputs, device)
    report = PrecisionReport(layers=layers, backend=chosen.name, device=used,
                             model=os.path.basename(path), exporter=exporter)
    if reference is not None and inputs is not None:
        report.numerics = check_numerics(path, reference, inputs, rtol=rtol, atol=atol,
                                         raise_on_error=False, device=device, proto=model)
        other = _other_sizes(model, inputs)
        if other is not None:  # (a file with dynamic axes: measured at other sizes too)
            rows = check_numerics(path, reference, other, rtol=rtol, atol=atol,
                                  raise_on_error=False, device=device, proto=model)
            for row in rows:
                row["output"] = f"{row['output']} at {shape_text(other)}"
            report.numerics += rows
    return report


def _other_sizes(model: Any, inputs: Sequence[Any]) -> Optional[tuple]:
    """The inputs at other sizes of the file's dynamic axes (``fxamp.dynamic_axes``, which
    ``export_onnx(..., dynamic_shapes=...)`` writes), or None for a file without them."""
    text = get_meta(model, AXES_KEY)
    if not text:
        return None
    case = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    axes = parse_axes(text, input_names(model))
    return other_shape(case, axes) if axes else None


def _true_fp16(path: str, session: Any, inputs: Sequence[Any], refs: List[Any],
               rows: List[Dict[str, Any]], proto: Any = None) -> None:
    """Add each row's true-FP16 result (``onnx.reference``, every op in its declared type):
    ``true_fp16_max_abs`` and ``true_fp16_ok`` (within ``TRUE_FP16_RTOL`` of the output's
    scale); where the reference evaluator cannot run the file, ``true_fp16_skipped`` says
    why instead. The export's own check on these inputs, stored in the file
    (:func:`_stored_true_fp16`), is read back rather than run again
    (``true_fp16_from``: ``"export check"``); a sampled output says so
    (``true_fp16_sampled``).

    Args:
        path: the ONNX file.
        session: the onnxruntime session of the numerics (for the input names).
        inputs: the inputs.
        refs: the FP32 model's outputs.
        rows: the numerics rows, one per output, filled in place.
        proto: the file, loaded already (default: loaded from ``path``).
    """
    import numpy as np
    import onnx

    from .overflow import unrunnable
    from .true_fp16 import run_bounded, sampled_like

    feed = feeds(session, inputs)
    proto = proto if proto is not None else onnx.load(path)
    stored = _stored_true_fp16(proto, list(feed.values()))
    if stored is not None and len(stored) == len(rows):
        for row, done in zip(rows, stored):
            _fill_true_fp16(row, float(done["max_abs"]), done.get("sampled"))
            row["true_fp16_from"] = "export check"
        return
    try:
        run = run_bounded(proto, feed)
    except Exception as err:  # noqa: BLE001 - an op onnx.reference lacks
        reason = unrunnable(err)
        log.warning("no true-FP16 result for %s: %s", path, reason)
        for row in rows:
            row["true_fp16_skipped"] = reason
        return
    for index, (row, out, ref) in enumerate(zip(rows, run.outputs, refs)):
        sampled = run.sampled.get(index)
        r = sampled_like(ref.detach().float().cpu(), sampled).numpy()
        o = np.asarray(out, dtype=np.float64)
        if o.shape != r.shape:
            continue
        finite = bool(np.isfinite(o).all())
        diff = float(np.abs(o - r).max()) if r.size else 0.0
        _fill_true_fp16(row, diff if finite else float("inf"),
                        sampled.text() if sampled is not None else None)


def _fill_true_fp16(row: Dict[str, Any], diff: float, sampled: Optional[str]) -> None:
    """Write one output's true-FP16 keys into its numerics ``row``.

    Args:
        row: the numerics row (its ``ref_max`` is the tolerance's scale).
        diff: the largest |true FP16 - FP32| (inf: not finite).
        sampled: what a sampled output compared (None: every value).
    """
    from .reference import TRUE_FP16_RTOL

    row["true_fp16_max_abs"] = diff
    row["true_fp16_ok"] = diff == diff and diff <= TRUE_FP16_RTOL * row["ref_max"]
    if sampled:
        row["true_fp16_sampled"] = sampled


def _stored_true_fp16(proto: Any, arrays: List[Any]) -> Optional[List[Dict[str, Any]]]:
    """The export's true-FP16 rows (``fxamp.true_fp16_rows``) where the file holds them for
    these very inputs (``fxamp.true_fp16_inputs``, their digest), else None.

    Args:
        proto: the ONNX file.
        arrays: the input values, in the graph's order.

    Returns:
        One row per output (``verify.true_fp16_row``), or None.
    """
    import json

    from .true_fp16 import DIGEST_KEY, ROWS_KEY, inputs_digest

    text = get_meta(proto, ROWS_KEY)
    if text is None or get_meta(proto, DIGEST_KEY) != inputs_digest(arrays):
        return None
    try:
        rows = json.loads(text)
    except ValueError:
        return None
    return rows if isinstance(rows, list) and all(
        isinstance(r, dict) and "max_abs" in r for r in rows) else None


def check_numerics(path: str, model_fp32: Any, example_inputs: Any, *, rtol: float = 1e-2,
                   atol: float = 1e-2, raise_on_error: bool = True,
                   device: Optional[str] = None, proto: Any = None) -> List[Dict[str, Any]]:
    """Run the ONNX model in onnxruntime (default optimizations) and the FP32 PyTorch model
    on the same inputs; per output: max abs error, max relative error (|d| / (|ref| + atol)),
    the largest |ref|, and ok = max abs error <= atol + rtol * max|ref|; and the file in
    true FP16 (``onnx.reference``): ``true_fp16_max_abs``, ``true_fp16_ok`` (within
    ``TRUE_FP16_RTOL`` of max|ref|). ``ok`` is the backend's result alone.

    Args:
        path: the ONNX file.
        model_fp32: the FP32 PyTorch model (run in eval mode; its mode is restored).
        example_inputs: the inputs of both (a tuple, or one tensor).
        rtol: the relative tolerance, of the largest |ref|.
        atol: the absolute tolerance.
        raise_on_error: raise when an output is over tolerance (else only report it).
        device: an onnxruntime provider to ask for (default CUDA when available, else CPU).
        proto: the file, loaded already (default: loaded from ``path`` for the true-FP16
            part). Where the file holds its export's true-FP16 check on these inputs, that
            result is read back (``true_fp16_from``), not run again.

    Returns:
        One dict per output, with the keys above.

    Raises:
        NumericsError: an output is over tolerance and ``raise_on_error`` is True.
    """
    import numpy as np
    import onnxruntime as ort
    import torch
    from .._torch import tree_flatten

    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    opts = lean_options(ort)
    opts.log_severity_level = 3
    session = ort.InferenceSession(path, opts, providers=providers(device))
    got = session.run(None, feeds(session, inputs))
    was = model_fp32.training
    model_fp32.eval()
    try:
        with torch.no_grad():
            ref_out = model_fp32(*inputs)
    finally:
        model_fp32.train(was)
    refs = [r for r in tree_flatten(ref_out)[0] if isinstance(r, torch.Tensor)]
    if len(refs) != len(got):
        raise NumericsError(f"the ONNX model has {len(got)} outputs, the PyTorch model "
                            f"{len(refs)}")
    rows = []
    for meta, out, ref in zip(session.get_outputs(), got, refs):
        r = ref.detach().float().cpu().numpy()
        o = np.asarray(out, dtype=np.float32)
        if o.shape != r.shape:
            raise NumericsError(f"output {meta.name}: shape {o.shape} vs PyTorch {r.shape}")
        diff = np.abs(o - r)
        ref_max = float(np.abs(r).max()) if r.size else 0.0
        max_abs = float(diff.max()) if diff.size else 0.0
        finite = bool(np.isfinite(o).all())
        rows.append({"output": meta.name, "max_abs": max_abs,
                     "max_rel": float((diff / (np.abs(r) + atol)).max()) if diff.size else 0.0,
                     "ref_max": ref_max,
                     "ok": finite and max_abs <= atol + rtol * ref_max})
    _true_fp16(path, session, inputs, refs, rows, proto)
    bad = [row for row in rows if not row["ok"]]
    if bad and raise_on_error:
        text = "; ".join(f"{row['output']}: max abs error {row['max_abs']:.3g} > "
                         f"{atol:g} + {rtol:g} * {row['ref_max']:.3g}" for row in bad)
        raise NumericsError(f"{os.path.basename(path)} differs from the FP32 model: {text}; "
                            "what to do: look at the precision report's fallbacks and keep the "
                            "sensitive layers in FP32 with a policy (e.g. 'fp32:head.*')")
    return rows
