"""Build a TensorRT engine from an ONNX file and read which precision each layer runs in.

NOT run by fxamp's tests (no TensorRT or GPU there); reading the inspector's JSON is
(:mod:`fxamp.export.trt_layers`). TensorRT is imported inside the functions.
"""
from __future__ import annotations

from typing import List

from ..errors import FxampError
from .layers import LayerPrecision
from .trt_layers import apply_engine_info


def tensorrt_available() -> bool:
    """Whether TensorRT imports and a CUDA GPU is present."""
    try:
        import tensorrt  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable
        return False
    import torch

    return torch.cuda.is_available()


def tensorrt_layers(path: str, layers: List[LayerPrecision]) -> str:  # pragma: no cover
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
