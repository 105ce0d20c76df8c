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

TensorRT: :func:`_tensorrt_layers` builds an engine (TensorRT 10/11 Python API; NOT run by
fxamp's tests: no TensorRT there) and reads its inspector JSON with
:mod:`fxamp.export.trt_layers`, which is tested on NVIDIA's published engine files; an engine
built elsewhere can be read with ``precision_report(..., engine_info=FILE)``.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from ..errors import FxampError
from ..plan import Plan
from ..ir import Rule
from ..policy import dtype_name
from .onnx_export import FX_NODE, MODULE
from .repairs import NOTE, get_meta, value_types
from .report import BackendUnavailableError, LayerPrecision, NumericsError, PrecisionReport
from .trt_layers import apply_engine_info

log = logging.getLogger(__name__)

_NAMES = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}
_FLOATS = set(_NAMES)
_NO_COMPUTE = {"Shape", "Size", "NonZero", "ConstantOfShape"}
TENSORRT_MISSING = ("backend='tensorrt' needs the TensorRT Python package and a CUDA GPU; "
                    "what to do: pip install tensorrt (on a machine with an NVIDIA GPU and "
                    "driver), or use backend='onnxruntime' / 'auto'")


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


def _compute_dtype(node: Any, types: Dict[str, int]) -> Optional[int]:
    """The float type a node computes in: its output's for a Cast, else its first float
    input's (else its first float output's)."""
    if node.op_type in _NO_COMPUTE:
        return None
    if node.op_type == "Cast":
        t = types.get(node.output[0])
        return t if t in _FLOATS else None
    for name in node.input:
        if name and types.get(name) in _FLOATS:
            return types[name]
    for name in node.output:
        if types.get(name) in _FLOATS:
            return types[name]
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
        exported = _compute_dtype(node, types)
        planned = _planned(plan, fx_node, node, types) if exported is not None else None
        layer = LayerPrecision(onnx_node=node.name, op_type=node.op_type, fx_node=fx_node,
                               module=get_meta(node, MODULE), planned=planned,
                               exported=_NAMES.get(exported) if exported else None,
                               note=(get_meta(node, NOTE) or "").strip())
        if planned and layer.exported and planned != layer.exported:
            layer.fallback = True
            layer.note = (f"exporter: computes in {layer.exported} in the ONNX file, plan "
                          f"says {planned}. " + layer.note).strip()
        layers.append(layer)
    return layers


# -- onnxruntime -------------------------------------------------------------------------
def _random_feeds(session: Any) -> Dict[str, Any]:
    import numpy as np

    kinds = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
             "tensor(double)": np.float64, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(bool)": np.bool_}
    rng = np.random.default_rng(0)
    feeds = {}
    for inp in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape]
        feeds[inp.name] = rng.standard_normal(shape).astype(kinds.get(inp.type, np.float32))
    return feeds


def _feeds(session: Any, inputs: Optional[Sequence[Any]]) -> Dict[str, Any]:
    if inputs is None:
        return _random_feeds(session)
    arrays = [x.detach().cpu().numpy() if hasattr(x, "detach") else x for x in inputs]
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(arrays):
        raise FxampError(f"the ONNX model takes {len(names)} inputs ({', '.join(names)}), "
                         f"got {len(arrays)}")
    return dict(zip(names, arrays))


def _providers(device: Optional[str]) -> List[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device:
        if device not in available:
            raise BackendUnavailableError(f"onnxruntime provider {device} is not available "
                                          f"here (available: {', '.join(available)})")
        return [device] + (["CPUExecutionProvider"] if device != "CPUExecutionProvider"
                           else [])
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _onnxruntime_layers(path: str, layers: List[LayerPrecision], inputs: Optional[Sequence[Any]],
                        device: Optional[str]) -> str:
    """Fill ``actual`` from an onnxruntime session; return the provider asked for."""
    import onnx
    import onnxruntime as ort

    providers = _providers(device)
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.optimized_model_filepath = os.path.join(tmp, "ort.onnx")
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(tmp, "profile")
        opts.log_severity_level = 3
        session = ort.InferenceSession(path, opts, providers=providers)
        session.run(None, _feeds(session, inputs))
        profile = session.end_profiling()
        with open(profile, encoding="utf-8") as fh:
            events = json.load(fh)
        ran = onnx.load(opts.optimized_model_filepath)
    ran_by = {}
    for event in events:
        args = event.get("args") or {}
        if event.get("cat") == "Node" and "provider" in args:
            ran_by[event["name"].rsplit("_kernel_time", 1)[0]] = args["provider"]
    types = value_types(ran)
    nodes = {n.name: n for n in ran.graph.node}
    inserted = {n.output[0]: n for n in ran.graph.node
                if n.name.startswith("InsertedPrecisionFreeCast")}
    main = providers[0]
    for layer in layers:
        node = nodes.get(layer.onnx_node)
        if node is None:
            layer.actual = None
            if layer.op_type == "Cast":
                layer.note = (layer.note + " removed by onnxruntime (redundant once it runs "
                              "the neighbours in fp32)" if layer.exported else layer.note).strip()
            else:
                layer.note = (layer.note + " removed or fused by onnxruntime").strip()
            continue
        dtype = _compute_dtype(node, types)
        layer.actual = _NAMES.get(dtype) if dtype else None
        provider = ran_by.get(layer.onnx_node, "")
        notes = []
        if layer.actual and layer.exported and layer.actual != layer.exported:
            casts = [i for i in node.input if i in inserted]
            notes.append(f"onnxruntime {provider or main} runs it in {layer.actual}: "
                         + (f"no {layer.exported} kernel, Cast inserted before it" if casts else
                            f"its {layer.exported} casts were dropped, it follows its "
                            f"{layer.actual} neighbours"))
        if provider and main != "CPUExecutionProvider" and provider == "CPUExecutionProvider":
            notes.append(f"assigned to CPUExecutionProvider, not {main}")
            layer.fallback = layer.fallback or bool(layer.planned)
        if layer.planned and layer.actual and layer.actual != layer.planned:
            layer.fallback = True
        if notes:
            layer.note = (layer.note + " " + "; ".join(notes)).strip()
    return main


# -- TensorRT (unverified here) ----------------------------------------------------------
def tensorrt_available() -> bool:
    """Whether TensorRT imports and a CUDA GPU is present."""
    try:
        import tensorrt  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable
        return False
    import torch

    return torch.cuda.is_available()


def _tensorrt_layers(path: str, layers: List[LayerPrecision]) -> str:  # pragma: no cover
    """Build a strongly typed TensorRT engine and read layer precisions from its inspector.

    The engine build is NOT run by fxamp's tests (no TensorRT or GPU there); reading the
    inspector's JSON is (:mod:`fxamp.export.trt_layers`, tested on NVIDIA's published engine
    files). A strongly typed network keeps the ONNX file's types, so TensorRT may not pick
    other precisions; the inspector still shows what each fused layer reads and writes.
    """
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(path):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise FxampError(f"TensorRT could not parse {path}: {errors}")
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise FxampError(f"TensorRT could not build an engine from {path}")
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    inspector = engine.create_engine_inspector()
    apply_engine_info(layers, inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    return "TensorRT"


# -- public API ---------------------------------------------------------------------------
def _resolve(backend: str) -> str:
    if backend == "auto":
        return "tensorrt" if tensorrt_available() else "onnxruntime"
    if backend == "tensorrt":
        if not tensorrt_available():
            raise BackendUnavailableError(TENSORRT_MISSING)
        return backend
    if backend == "onnxruntime":
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise BackendUnavailableError("backend='onnxruntime' needs onnxruntime; what to "
                                          "do: pip install onnxruntime") from None
        return backend
    raise FxampError(f"backend must be onnxruntime, tensorrt or auto, got {backend!r}")


def precision_report(path: str, plan: Optional[Plan] = None, backend: str = "auto", *,
                     inputs: Optional[Sequence[Any]] = None, reference: Any = None,
                     device: Optional[str] = None, rtol: float = 1e-2,
                     atol: float = 1e-2, engine_info: Any = None) -> PrecisionReport:
    """Per-layer precision of the ONNX model at ``path`` against ``plan`` on ``backend``.

    plan: the fxamp Plan (default: the one export_onnx stored in the file). backend:
    "onnxruntime", "tensorrt" or "auto" (TensorRT when it imports and a GPU exists). inputs:
    the example inputs (default: random, dynamic dims 1). reference: the FP32 PyTorch model;
    when given with ``inputs`` the report's ``numerics`` holds the per-output errors (without
    raising; use :func:`check_numerics` to fail above tolerance). device: an onnxruntime
    provider to ask for (default CUDA when available, else CPU). engine_info: the inspector JSON
    of a TensorRT engine built from this file elsewhere (path, text or dict; e.g. from
    ``trtexec --exportLayerInfo``): ``actual`` is read from it, nothing is built or run.
    """
    if engine_info is not None:
        model = _load(path)
        layers = _exported_layers(model, _plan_from(model, plan))
        apply_engine_info(layers, engine_info)
        return PrecisionReport(layers=layers, backend="tensorrt", device="inspector JSON",
                               model=os.path.basename(path),
                               exporter=next((p.value for p in model.metadata_props
                                              if p.key == "fxamp.exporter"), ""))
    chosen = _resolve(backend)
    model = _load(path)
    plan = _plan_from(model, plan)
    exporter = next((p.value for p in model.metadata_props if p.key == "fxamp.exporter"), "")
    layers = _exported_layers(model, plan)
    if chosen == "tensorrt":  # pragma: no cover - needs TensorRT and a GPU
        try:
            used = _tensorrt_layers(path, layers)
        except Exception as err:  # noqa: BLE001 - the TensorRT path is unverified
            if backend != "auto":
                raise
            log.warning("TensorRT inspection failed (%s); using onnxruntime", err)
            chosen, layers = "onnxruntime", _exported_layers(model, plan)
    if chosen == "onnxruntime":
        used = _onnxruntime_layers(path, layers, inputs, device)
    report = PrecisionReport(layers=layers, backend=chosen, device=used,
                             model=os.path.basename(path), exporter=exporter)
    if reference is not None and inputs is not None:
        report.numerics = check_numerics(path, reference, inputs, rtol=rtol, atol=atol,
                                         raise_on_error=False, device=device)
    return report


def check_numerics(path: str, model_fp32: Any, example_inputs: Any, *, rtol: float = 1e-2,
                   atol: float = 1e-2, raise_on_error: bool = True,
                   device: Optional[str] = None) -> List[Dict[str, Any]]:
    """Run the ONNX model in onnxruntime (default optimizations) and the FP32 PyTorch model
    on the same inputs; per output: max abs error, max relative error (|d| / (|ref| + atol)),
    the largest |ref|, and ok = max abs error <= atol + rtol * max|ref|.

    Raises :class:`NumericsError` (an FxampError) when an output is over tolerance, unless
    ``raise_on_error`` is False.
    """
    import numpy as np
    import onnxruntime as ort
    import torch
    from .._torch import tree_flatten

    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(path, opts, providers=_providers(device))
    got = session.run(None, _feeds(session, inputs))
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
    bad = [row for row in rows if not row["ok"]]
    if bad and raise_on_error:
        text = "; ".join(f"{row['output']}: max abs error {row['max_abs']:.3g} > "
                         f"{atol:g} + {rtol:g} * {row['ref_max']:.3g}" for row in bad)
        raise NumericsError(f"{os.path.basename(path)} differs from the FP32 model: {text}; "
                            "what to do: look at the precision report's fallbacks and keep the "
                            "sensitive layers in FP32 with a policy (e.g. 'fp32:head.*')")
    return rows
