"""ONNX export of rewritten models and precision reports of what backends really run.

``import fxamp`` does not import this package; importing it does not import onnx or
onnxruntime either (they are imported when a function runs). Install them with
``pip install 'fxamp[onnx]'``.
"""
from __future__ import annotations

from .backends import CHOICES as BACKEND_CHOICES, Backend, get_backend
from .engine_report import check_numerics, precision_report
from .errors import (BackendUnavailableError, DynamicShapesError, ExportError, NumericsError,
                     UnknownBackendError)
from .layers import LayerPrecision
from .onnx_export import export_onnx
from .overflow import PlanOverflowError, run_true_fp16
from .verify import ExporterNumbersError
from .predict import SOURCES, Prediction, predict, predict_fp16
from .report import SCHEMA, PrecisionReport
from .trt_build import tensorrt_available

__all__ = ["export_onnx", "precision_report", "check_numerics", "tensorrt_available",
           "PrecisionReport", "LayerPrecision", "ExportError", "BackendUnavailableError",
           "NumericsError", "DynamicShapesError", "PlanOverflowError", "ExporterNumbersError",
           "run_true_fp16",
           "SCHEMA", "predict",
           "predict_fp16", "Prediction", "SOURCES", "Backend", "BACKEND_CHOICES",
           "get_backend", "UnknownBackendError"]
