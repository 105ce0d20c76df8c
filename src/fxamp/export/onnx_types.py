"""The floating ONNX element types and the type an ONNX node computes in (what the
precision report compares: the exported file's and what a backend ran)."""
from __future__ import annotations

from typing import Any, Dict, Optional

#: ONNX TensorProto element type -> short dtype name, for the floating types (the one
#: table: the repairs' notes and the Model Explorer overlay read it too)
ONNX_FLOAT_NAMES = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}
_FLOATS = set(ONNX_FLOAT_NAMES)
_NO_COMPUTE = {"Shape", "Size", "NonZero", "ConstantOfShape"}


def compute_dtype(node: Any, types: Dict[str, int]) -> Optional[int]:
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
