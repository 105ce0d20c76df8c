"""Static FP16/BF16 predictions for machines without a GPU.

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
(``tensorrt_ops.py``) and :data:`ORT_CUDA_TYPES` (``ort_cuda_ops.py``); each backend of
:mod:`fxamp.export.backends` reads its own (``Backend.support``, in ``op_support.py``), and
its predictions are keyed by its ``table`` name (:data:`BACKENDS`).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from .backends import REGISTRY, get_backend
from .op_support import SOURCES, Prediction
from .ort_cuda_ops import ORT_CUDA_TYPES
from .tensorrt_ops import TENSORRT_TYPES

#: the support tables by the key a report records predictions under, TensorRT first
BACKENDS: Tuple[str, ...] = tuple(b.table for b in REGISTRY.values())
_BY_TABLE = {b.table: b for b in REGISTRY.values()}
assert set(SOURCES) == set(BACKENDS)

_DTYPES = ("fp16", "bf16")


def predict(op_type: str, backend: str, dtype: str = "fp16") -> Prediction:
    """The documented support of ``op_type`` (an ai.onnx op name) in ``dtype`` on
    ``backend``: a backend name ("tensorrt", "onnxruntime": its CUDA provider's table) or a
    table key ("onnxruntime-cuda")."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'fp16' or 'bf16', got {dtype!r}")
    found = _BY_TABLE.get(backend) or get_backend(backend)
    return found.support(op_type, dtype)


def predict_fp16(op_type: str, backend: str) -> Prediction:
    """:func:`predict` for FP16."""
    return predict(op_type, backend, "fp16")


def predicted_fallbacks(op_type: str, planned: Optional[str],
                        backends: Tuple[str, ...] = BACKENDS) -> Dict[str, str]:
    """table key -> note, for each backend the tables say will not run ``op_type`` in the
    ``planned`` dtype ("fp16"/"bf16"; anything else: empty)."""
    if planned not in _DTYPES:
        return {}
    out = {}
    for backend in backends:
        p = predict(op_type, backend, planned)
        if p.supported is False:
            out[p.backend] = p.note
    return out


__all__ = ["BACKENDS", "SOURCES", "Prediction", "TENSORRT_TYPES", "ORT_CUDA_TYPES", "predict",
           "predict_fp16", "predicted_fallbacks"]
