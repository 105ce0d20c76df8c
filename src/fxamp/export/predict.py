"""Static FP16/BF16 predictions for machines without a GPU.

The tables, their sources and what the predictions are worth are described in
:mod:`fxamp.export.op_support`, which reads them.

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
    """The documented support of ``op_type`` in ``dtype`` on ``backend``.

    Args:
        op_type: an ai.onnx op name (``"LayerNormalization"``).
        backend: a backend name (``"tensorrt"``, ``"onnxruntime"``: its CUDA provider's
            table) or a table key (``"onnxruntime-cuda"``).
        dtype: ``"fp16"`` or ``"bf16"``.

    Returns:
        The ``Prediction`` (``supported`` None when the op is not in the table).

    Raises:
        ValueError: another ``dtype``.
        UnknownBackendError: an unknown ``backend``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'fp16' or 'bf16', got {dtype!r}")
    found = _BY_TABLE.get(backend) or get_backend(backend)
    return found.support(op_type, dtype)


def predict_fp16(op_type: str, backend: str) -> Prediction:
    """``predict`` for FP16.

    Args:
        op_type: an ai.onnx op name.
        backend: a backend name or table key, as for ``predict``.

    Returns:
        The ``Prediction``.
    """
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
