"""What onnxruntime really runs: a session with graph optimizations off whose saved graph shows
the Casts onnxruntime inserts around kernels it lacks in FP16, and whose profile names the
provider that ran each node (:func:`onnxruntime_layers`); the inputs and providers a session
is given. onnxruntime is imported inside the functions."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from ..errors import FxampError
from .onnx_types import ONNX_FLOAT_NAMES, compute_dtype
from .repairs import value_types
from .errors import BackendUnavailableError
from .layers import LayerPrecision


def lean_options(ort: Any) -> Any:
    """onnxruntime session options that hold no memory arena: the CPU arena and the memory
    pattern planner keep the peak of a run allocated for the session's life (on GPT-2
    small in FP16, 1.2 GB of the session's memory where 0.5 GB are in use), which checks
    and reports run once or twice do not need; the numbers are the same.

    Args:
        ort: the onnxruntime module.

    Returns:
        New ``SessionOptions``.
    """
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    return options


def random_feeds(session: Any) -> Dict[str, Any]:
    """Seeded random values for each input of ``session`` (dynamic dims 1)."""
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


def feeds(session: Any, inputs: Optional[Sequence[Any]]) -> Dict[str, Any]:
    """``session``'s input names -> ``inputs`` as arrays (random ones when None)."""
    if inputs is None:
        return random_feeds(session)
    arrays = [x.detach().cpu().numpy() if hasattr(x, "detach") else x for x in inputs]
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(arrays):
        raise FxampError(f"the ONNX model takes {len(names)} inputs ({', '.join(names)}), "
                         f"got {len(arrays)}")
    return dict(zip(names, arrays))


def providers(device: Optional[str]) -> List[str]:
    """The providers to ask for: ``device`` (then CPU), else CUDA when there, else CPU."""
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


def onnxruntime_layers(path: str, layers: List[LayerPrecision], inputs: Optional[Sequence[Any]],
                        device: Optional[str]) -> str:
    """Fill ``actual`` from an onnxruntime session; return the provider asked for."""
    import onnx
    import onnxruntime as ort

    asked = providers(device)
    with tempfile.TemporaryDirectory() as tmp:
        opts = lean_options(ort)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.optimized_model_filepath = os.path.join(tmp, "ort.onnx")
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(tmp, "profile")
        opts.log_severity_level = 3
        session = ort.InferenceSession(path, opts, providers=asked)
        session.run(None, feeds(session, inputs))
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
    main = asked[0]
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
        dtype = compute_dtype(node, types)
        layer.actual = ONNX_FLOAT_NAMES.get(dtype) if dtype else None
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
