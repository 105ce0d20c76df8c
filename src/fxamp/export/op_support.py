"""The FP16/BF16 support tables of the backends, read as predictions (no GPU needed).

Which ONNX ops TensorRT and onnxruntime's CUDA execution provider can run in FP16 (and BF16),
transcribed by hand from their published operator-support matrices, so a precision report can
say "TensorRT will not run this op in FP16" before anyone builds an engine. These are
PREDICTIONS from documentation, not measurements: an op the table lists as FP16-capable can
still fall back (unsupported attributes, restrictions in the source's "Restrictions" column,
layer fusion, tactic choice), and the tables age. Nothing here reads files or the network.

Sources (see :data:`SOURCES`):

* TensorRT: onnx-tensorrt ``docs/operators.md``, the revision whose header reads "TensorRT
  10.15 supports operators in the inclusive range of opset 9 to opset 24" (its commit hash was
  not recorded).
  Column "Supported Types" per op; ops marked ``N`` are not supported by the parser at all.
  Older revisions differ: the ``onnx/onnx-tensorrt`` commit
  6d0ab7be324d02c7feb3a306b6fdbeae84f71ddc (TensorRT 8.5) lists LayerNormalization as ``N``
  and has no BF16 column; commit 009d6541b4ee1fa3f3150cd7cbabe7e56aa54840 (TensorRT 8.4)
  lists RoiAlign as ``N``.
* onnxruntime CUDA: ``microsoft/onnxruntime`` ``docs/OperatorKernels.md`` at commit
  001d12d2623fd411ce0f83d05abb5e82304a3389, section "Operators implemented by
  CUDAExecutionProvider", domain ``ai.onnx``. Recorded: the floating types of the op's main
  type constraint (``T``/``T1``) in its NEWEST registered opset row (older opsets sometimes
  lack float16/bfloat16, e.g. CumSum [11, 13] has no float16). Ops listed as ``None`` have no
  CUDA kernel in that section (checked by their place in the alphabetical list); onnxruntime
  then runs them on another provider (CPU). When a CUDA kernel lacks float16, the node does
  not run in FP16 on the CUDA provider (onnxruntime inserts Casts to float32 or assigns the
  node to another provider).

Only ``ai.onnx`` ops are covered; contrib ops (``com.microsoft``) and custom ops are unknown
(``supported=None``).

The two tables are data modules of their own, re-exported here: :data:`TENSORRT_TYPES`
(``tensorrt_ops.py``) and :data:`ORT_CUDA_TYPES` (``ort_cuda_ops.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .ort_cuda_ops import ORT_CUDA_TYPES
from .tensorrt_ops import TENSORRT_TYPES

SOURCES: Dict[str, Dict[str, str]] = {
    "tensorrt": {
        "repo": "onnx/onnx-tensorrt", "path": "docs/operators.md",
        "version": "TensorRT 10.15 (opset 9-24) revision",
        "commit": "not recorded (the revision whose header names TensorRT 10.15, opset 9-24)",
        "short": "onnx-tensorrt docs/operators.md @ TensorRT 10.15",
    },
    "onnxruntime-cuda": {
        "repo": "microsoft/onnxruntime", "path": "docs/OperatorKernels.md",
        "version": "CUDAExecutionProvider, ai.onnx domain, newest opset row per op",
        "commit": "001d12d2623fd411ce0f83d05abb5e82304a3389",
        "short": "onnxruntime docs/OperatorKernels.md @ 001d12d",
    },
}

_NAMES = {"fp16": ("FP16", "fp16", "float16", "FP16"), "bf16": ("BF16", "bf16", "bfloat16",
                                                                 "BF16")}


@dataclass(frozen=True)
class Prediction:
    """A documented (not measured) answer: can ``backend`` run ``op_type`` in the dtype?

    Attributes:
        op_type: the ai.onnx op name.
        backend: the backend or table key asked about.
        dtype: ``"fp16"`` or ``"bf16"``.
        supported: True / False, or None when the op is not in the table.
        note: one sentence, starting with "prediction (<source>)".
        source: the document it comes from.
    """

    op_type: str
    backend: str
    dtype: str
    supported: Optional[bool]
    note: str
    source: str


def _check(dtype: str) -> None:
    if dtype not in _NAMES:
        raise ValueError(f"dtype must be 'fp16' or 'bf16', got {dtype!r}")


def _asked(op_type: str, backend: str, dtype: str, table: Dict[str, Any],
           where: str) -> Tuple[Callable[[Optional[bool], str], Prediction], Any,
                                Optional[Prediction]]:
    """What ``backend``'s ``table`` holds for ``op_type``: the maker of its predictions (a
    verdict and the sentence after "prediction (<source>): "), the table's entry, and the
    answer when the op is not in the table (``where`` names the table)."""
    _check(dtype)
    source = SOURCES[backend]["short"]

    def answer(supported: Optional[bool], text: str) -> Prediction:
        return Prediction(op_type, backend, dtype, supported, f"prediction ({source}): {text}",
                          source)
    if op_type not in table:
        return answer, None, answer(None, f"{op_type} is not in the {where}; no prediction")
    return answer, table[op_type], None


def tensorrt_support(op_type: str, dtype: str = "fp16") -> Prediction:
    """What onnx-tensorrt's operator table says of ``op_type`` (an ai.onnx op) in ``dtype``."""
    answer, types, unknown = _asked(op_type, "tensorrt", dtype, TENSORRT_TYPES,
                                    "TensorRT operator table")
    if unknown is not None:
        return unknown
    upper = _NAMES[dtype][0]
    if types is None:
        return answer(False, f"TensorRT does not support {op_type} at all; the ONNX parser "
                      "will reject it")
    if upper in types.split():
        return answer(True, f"TensorRT lists {upper} for {op_type}")
    return answer(False, f"TensorRT has no {upper} {op_type} (types: "
                  f"{types.replace(' ', ', ')}); it will run in FP32")


def ort_cuda_support(op_type: str, dtype: str = "fp16") -> Prediction:
    """What onnxruntime's kernel table says of ``op_type`` (an ai.onnx op) in ``dtype`` on its
    CUDA execution provider."""
    answer, entry, unknown = _asked(op_type, "onnxruntime-cuda", dtype, ORT_CUDA_TYPES,
                                    "onnxruntime CUDA table here")
    if unknown is not None:
        return unknown
    upper, ort_name = _NAMES[dtype][0], _NAMES[dtype][1]
    label = "onnxruntime's CUDA provider"
    if entry is None:
        return answer(False, f"{label} has no {op_type} kernel; it will run on another "
                      f"provider (CPU), not in {upper} on the GPU")
    opset, _, types = entry.partition(" ")
    if ort_name in types.split():
        return answer(True, f"{label} registers {upper} {op_type} (opset {opset})")
    return answer(False, f"{label} has no {upper} {op_type} kernel (opset {opset}: "
                  f"{types.replace(' ', ', ')}); it will not run in {upper} there "
                  "(onnxruntime casts it to FP32 or places it on another provider)")
