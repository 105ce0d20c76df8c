"""The errors of the export stages: the export itself, a backend that is not here or not
known, numerics off the FP32 model. Below every export module (the backends, the reports and
the export all raise them); :mod:`fxamp.export` and :mod:`.report` re-export them."""
from __future__ import annotations

from ..errors import FxampError


class ExportError(FxampError):
    """The rewritten model could not be exported to ONNX."""


class BackendUnavailableError(FxampError):
    """The asked-for inference backend (or the hardware it needs) is not installed here."""


class UnknownBackendError(FxampError, ValueError):
    """A backend name that no backend of the registry (or alias) has."""


class NumericsError(FxampError):
    """The exported model's outputs differ from the FP32 PyTorch model beyond tolerance."""


class DynamicShapesError(ExportError):
    """An ONNX file with dynamic axes cannot be made as asked: an axis torch.export fixes
    (the model's code needs that size), a spec naming no input, or a rewritten graph that
    cannot be traced again with dynamic shapes; the message names the cause and what to do."""
