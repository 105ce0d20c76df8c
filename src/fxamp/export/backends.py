"""Export backends behind one protocol and one registry of names, like the front ends.

Every backend is an object with

- ``name``: the one name the API, the CLI (``fxamp export --backend``) and the precision
  report use (``onnxruntime``, ``tensorrt``); :data:`ALIASES` maps older spellings to it;
- ``available()``: whether it can run here (its package imports, its device exists), and
  ``missing``: what to do when it cannot;
- ``run(path, layers, inputs, device)``: the layers it really ran: fills each row's
  ``actual`` (and fallbacks) of the precision report and returns the device or provider
  it ran on;
- ``table`` and ``support(op_type, dtype)``: its FP16/BF16 support table, read as a
  :class:`~fxamp.export.op_support.Prediction` (documentation, not a measurement);
  ``table`` is the key those predictions are recorded under in a report (onnxruntime's
  table is its CUDA provider's: ``onnxruntime-cuda``).

:data:`REGISTRY` holds them by name, in the order predictions are listed; :func:`get_backend`
resolves a name or alias, :func:`choose` also ``"auto"`` (TensorRT when it runs here, else
onnxruntime). Heavy packages (onnxruntime, tensorrt) are imported only when a backend runs.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .op_support import Prediction, ort_cuda_support, tensorrt_support
from .ort_layers import onnxruntime_layers
from .errors import BackendUnavailableError, UnknownBackendError
from .layers import LayerPrecision
from .trt_build import tensorrt_available, tensorrt_layers


class Backend:
    """The protocol of an export backend (see the module docstring); subclasses fill it."""

    name: str = ""
    label: str = ""
    table: str = ""
    missing: str = ""

    def available(self) -> bool:
        """Whether this backend can run here."""
        raise NotImplementedError

    def run(self, path: str, layers: List[LayerPrecision], inputs: Optional[Sequence[Any]],
            device: Optional[str]) -> str:
        """Run the ONNX file at ``path`` and fill ``actual`` of ``layers``.

        Args:
            path: the ONNX file.
            layers: its layers, as ``precision_report`` read them from the file.
            inputs: the example inputs (None: random, dynamic dims 1).
            device: an onnxruntime provider to ask for (None: the backend's default).

        Returns:
            The device used, in words.
        """
        raise NotImplementedError

    def support(self, op_type: str, dtype: str = "fp16") -> Prediction:
        """Its published table's answer for ``op_type`` in ``dtype``.

        Args:
            op_type: an ai.onnx op name.
            dtype: ``"fp16"`` or ``"bf16"``.

        Returns:
            The ``Prediction``.
        """
        raise NotImplementedError


class OnnxRuntimeBackend(Backend):
    """onnxruntime: a real session (the CUDA provider when there, else CPU); its table is the
    CUDA provider's kernel list."""

    name = "onnxruntime"
    label = "onnxruntime"
    table = "onnxruntime-cuda"
    missing = "backend='onnxruntime' needs onnxruntime; what to do: pip install onnxruntime"

    def available(self) -> bool:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return False
        return True

    def run(self, path: str, layers: List[LayerPrecision], inputs: Optional[Sequence[Any]],
            device: Optional[str]) -> str:
        return onnxruntime_layers(path, layers, inputs, device)

    def support(self, op_type: str, dtype: str = "fp16") -> Prediction:
        return ort_cuda_support(op_type, dtype)


class TensorRTBackend(Backend):
    """TensorRT: a strongly typed engine built here and read with its inspector (needs
    TensorRT and a CUDA GPU); its table is onnx-tensorrt's operator list."""

    name = "tensorrt"
    label = "TensorRT"
    table = "tensorrt"
    missing = ("backend='tensorrt' needs the TensorRT Python package and a CUDA GPU; what to "
               "do: pip install tensorrt (on a machine with an NVIDIA GPU and driver), or use "
               "backend='onnxruntime' / 'auto'")

    def available(self) -> bool:
        return tensorrt_available()

    def run(self, path: str, layers: List[LayerPrecision], inputs: Optional[Sequence[Any]],
            device: Optional[str]) -> str:  # pragma: no cover - needs TensorRT and a GPU
        return tensorrt_layers(path, layers)

    def support(self, op_type: str, dtype: str = "fp16") -> Prediction:
        return tensorrt_support(op_type, dtype)


TENSORRT = TensorRTBackend()
ONNXRUNTIME = OnnxRuntimeBackend()

#: every backend by name, in the order a report lists their predictions
REGISTRY: Dict[str, Backend] = {b.name: b for b in (TENSORRT, ONNXRUNTIME)}
#: older spellings -> (backend name, the onnxruntime provider the spelling asks for)
ALIASES: Dict[str, Tuple[str, Optional[str]]] = {
    "onnxruntime-cuda": ("onnxruntime", "CUDAExecutionProvider"),
}
#: what ``backend=`` takes (``fxamp export --backend``): auto, then the names
CHOICES: Tuple[str, ...] = ("auto",) + tuple(sorted(REGISTRY))
assert all(name in REGISTRY for name, _ in ALIASES.values())
assert len({b.table for b in REGISTRY.values()}) == len(REGISTRY)


def _unknown(backend: str, auto: bool) -> UnknownBackendError:
    names = sorted(REGISTRY)
    valid = (", ".join(names) + " or auto") if auto else " or ".join(names)
    return UnknownBackendError(f"backend must be {valid}, got {backend!r}")


def get_backend(name: str) -> Backend:
    """The backend a name or alias (``onnxruntime-cuda``) names.

    Args:
        name: a name of ``REGISTRY`` or an alias.

    Returns:
        The ``Backend``.

    Raises:
        UnknownBackendError: anything else (an FxampError and ValueError listing the
            names).
    """
    if name in REGISTRY:
        return REGISTRY[name]
    if name in ALIASES:
        return REGISTRY[ALIASES[name][0]]
    raise _unknown(name, auto=False)


def choose(name: str) -> Backend:
    """The backend ``precision_report(backend=name)`` runs: ``"auto"`` is TensorRT when it is
    available, else onnxruntime; a named one that is not available raises
    BackendUnavailableError saying what to do."""
    if name == "auto":
        return TENSORRT if TENSORRT.available() else ONNXRUNTIME
    if name not in REGISTRY and name not in ALIASES:
        raise _unknown(name, auto=True)
    backend = get_backend(name)
    if not backend.available():
        raise BackendUnavailableError(backend.missing)
    return backend


def alias_device(name: str) -> Optional[str]:
    """The onnxruntime provider an alias asks for (``onnxruntime-cuda``: CUDA), else None."""
    return ALIASES.get(name, (name, None))[1]


__all__ = ["Backend", "OnnxRuntimeBackend", "TensorRTBackend", "REGISTRY", "ALIASES",
           "CHOICES", "TENSORRT", "ONNXRUNTIME", "get_backend", "choose", "alias_device"]
