"""Where a low-precision plan overflows, and how the exported file runs in true FP16.

:func:`find_overflow` runs the rewritten model node by node on an input and returns the first
node whose low-precision output is not finite while its inputs are, with the magnitude the
same call reaches in FP32: the number that says why the plan fails there.

:func:`run_true_fp16` runs an ONNX file with ``onnx.reference.ReferenceEvaluator``, which
computes every op in its declared types (an FP16 MatMul in FP16, unlike onnxruntime's CPU
provider, which runs most FP16 nodes in FP32 and hides an FP16 overflow): an emulation of what
an FP16 engine computes.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
from .._torch import tree_flatten, tree_map

from ..errors import node_error
from ..graph_run import GraphRun
from ..policy import dtype_name
from .errors import ExportError
from .reference_ops import evaluator

_LOW = (torch.float16, torch.bfloat16)


class PlanOverflowError(ExportError):
    """The plan's low precision overflows on the example inputs (a number, not the export)."""


@dataclass(frozen=True)
class Overflow:
    """The first node whose low-precision output is not finite while its inputs are."""

    node: fx.Node
    dtype: torch.dtype
    fp32_max: float  # the largest magnitude the same call gives in FP32

    def error(self, what: str) -> PlanOverflowError:
        """The error to raise: the node, its range, the fixes."""
        name = self.node.name
        limit = torch.finfo(self.dtype).max
        return node_error(  # type: ignore[return-value]
            PlanOverflowError, self.node,
            f"the {dtype_name(self.dtype)} plan overflows at node {name!r} on {what}: its "
            f"output reaches {self.fp32_max:.3g} in FP32, past {dtype_name(self.dtype)}'s max "
            f"{limit:.6g}, so it is inf/NaN in {dtype_name(self.dtype)} (the traced graph is "
            "right; onnxruntime's CPU provider runs such nodes in FP32 and hides it)",
            "give amp_rewrite calibration_data with inputs like this one (the ranges pass "
            "keeps what overflows in FP32), rewrite with target='tensorrt' (ranges from the "
            "example inputs), run fxamp's tolerance search, or keep the node in FP32 with the "
            f"policy override 'fp32:{name}'")


def _floats(value: Any) -> List[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Finder(GraphRun):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.found: Optional[Overflow] = None

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if self.found is not None or n.op not in ("call_function", "call_method",
                                                   "call_module"):
            return result
        outs = [t for t in _floats(result) if t.dtype in _LOW]
        if not outs or all(bool(torch.isfinite(t).all()) for t in outs):
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if not all(bool(torch.isfinite(t).all()) for t in _floats((args, kwargs))):
            return result
        up = tree_map(lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW
                      else v, (args, kwargs))
        try:
            with torch.no_grad():
                wide = getattr(self, n.op)(n.target, *up)
            peak = max(float(t.abs().max()) for t in _floats(wide) if t.numel())
        except Exception:  # noqa: BLE001 - the FP32 value is a detail of the message
            peak = float("inf")
        self.found = Overflow(n, outs[0].dtype, peak)
        return result


def find_overflow(gm: fx.GraphModule, inputs: tuple) -> Optional[Overflow]:
    """The first node of ``gm`` whose low-precision output overflows on ``inputs``, or None."""
    if not isinstance(gm, fx.GraphModule):
        return None
    finder = _Finder(gm)
    try:
        with torch.no_grad():
            finder.run(*inputs)
    except Exception:  # noqa: BLE001 - a model fx cannot interpret node by node
        return None
    return finder.found


def unrunnable(err: BaseException) -> str:
    """Why a file was not checked in true FP16, for the warning, the file's metadata
    (``fxamp.true_fp16_skipped``) and the report: ``run_true_fp16`` raised ``err``."""
    first = str(err).splitlines()[0] if str(err) else ""
    return f"onnx.reference cannot run the file ({type(err).__name__}: {first})"


def run_true_fp16(proto: Any, feed: Dict[str, Any]) -> List[Any]:
    """The outputs of an ONNX model with every op computed in its declared type (by
    ``onnx.reference.ReferenceEvaluator``; Conv and MaxPool by PyTorch kernels that round
    as its own do, ``fxamp.export.reference_ops``).

    Args:
        proto: the ONNX model (a ``ModelProto``).
        feed: input name -> numpy array.

    Returns:
        The outputs, in the graph's order (each intermediate value is dropped after its
        last use: ``true_fp16.run_bounded``, nothing sampled).
    """
    from .true_fp16 import run_bounded

    return run_bounded(proto, feed, limit=sys.maxsize).outputs


def first_nonfinite_node(proto: Any, feed: Dict[str, Any]) -> Optional[Any]:
    """The first ONNX node whose output is inf/NaN in true FP16 while its inputs are finite
    (``ReferenceEvaluator`` with the intermediate results), or None."""
    import numpy as np

    values = evaluator(proto).run(None, feed, intermediate=True)

    def finite(name: str) -> bool:
        v = values.get(name)
        return not (isinstance(v, np.ndarray) and v.dtype.kind == "f"
                    and not np.isfinite(v).all())
    for node in proto.graph.node:
        if all(finite(i) for i in node.input if i) and not all(finite(o) for o in node.output):
            return node
    return None


def fp32_twin(proto: Any) -> Any:
    """A copy of ONNX model ``proto`` computing in FP32 where it computes in FP16 or BF16:
    initializers, constants, Casts and declared types widened."""
    import numpy as np
    from onnx import numpy_helper

    twin = type(proto)()
    twin.CopyFrom(proto)
    graph = twin.graph
    for init in graph.initializer:
        if init.data_type in (10, 16):
            init.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(init).astype(np.float32), init.name))
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and node.op_type == "Cast" and attr.i in (10, 16):
                attr.i = 1
            if attr.type == attr.TENSOR and attr.t.data_type in (10, 16):
                attr.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type in (10, 16):
            value.type.tensor_type.elem_type = 1
    return twin


def first_divergent_node(proto: Any, feed: Dict[str, Any], rtol: float) -> Optional[Any]:
    """The first ONNX node whose true-FP16 output differs from the same node of the file's
    FP32 twin (:func:`fp32_twin`) by more than ``rtol`` of its scale, or None."""
    import numpy as np

    try:
        low = evaluator(proto).run(None, feed, intermediate=True)
        wide = evaluator(fp32_twin(proto)).run(None, feed, intermediate=True)
    except Exception:  # noqa: BLE001 - the culprit is a detail of the message
        return None

    def off(name: str) -> bool:
        a, b = low.get(name), wide.get(name)
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype.kind == "f" and b.dtype.kind == "f" and a.shape == b.shape
                and b.size):
            return False
        a, b = a.astype(np.float64), b.astype(np.float64)
        scale = float(np.abs(b[np.isfinite(b)]).max()) if np.isfinite(b).any() else 0.0
        diff = np.abs(np.nan_to_num(a - b, nan=np.inf))
        return bool((diff > rtol * max(scale, 1e-12)).any())
    for node in proto.graph.node:
        if not any(off(i) for i in node.input if i) and any(off(o) for o in node.output):
            return node
    return None
