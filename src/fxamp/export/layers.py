"""One layer's precision (:class:`LayerPrecision`): what each backend's run reports per ONNX
node or engine layer (``ort_layers``, ``trt_build``), and what a precision report
(:mod:`.report`) holds. Below the backends and the reports alike."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class LayerPrecision:
    """One ONNX node (one engine layer for TensorRT) and its precision.

    Attributes:
        onnx_node: the ONNX node's name.
        op_type: its ai.onnx op type (``"MatMul"``).
        fx_node: the fx node it came from (None: not mapped).
        module: that node's module path.
        planned: the dtype the fxamp plan gives its fx node (None: unmapped or not
            floating).
        exported: the dtype it computes in inside the exported ONNX model.
        actual: the dtype the backend really runs it in (None: removed/fused by the
            backend).
        fallback: actual (or exported) differs from planned.
        note: who changed it and why.
        predictions: backend -> note, for backends whose published operator table says
            they will not run this op in the planned dtype (a prediction, not measured;
            see ``fxamp.export.predict``).
    """

    onnx_node: str
    op_type: str
    fx_node: Optional[str] = None
    module: Optional[str] = None
    planned: Optional[str] = None
    exported: Optional[str] = None
    actual: Optional[str] = None
    fallback: bool = False
    note: str = ""
    predictions: Dict[str, str] = field(default_factory=dict)
