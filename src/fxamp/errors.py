"""Errors fxamp raises. Each names the node, its source line and what to do."""
from __future__ import annotations

import os
from typing import Optional

import torch.fx


class FxampError(Exception):
    """Base class of every error fxamp raises on bad input."""


class TraceError(FxampError):
    """The model could not be traced into a graph."""


class PolicyError(FxampError, ValueError):
    """A policy string or object is malformed."""


class UnsupportedModelError(FxampError):
    """The model (or one of its nodes) cannot be rewritten as asked."""


class PlanFormatError(FxampError, ValueError):
    """A plan file is malformed, truncated or not UTF-8 text; the message names the line."""


class OutputFileError(FxampError, OSError):
    """A file could not be written (permissions, full disk, bad path); the old file, if
    any, is unchanged. ``errno`` and ``filename`` are those of the underlying OSError."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class TrainingDivergedError(FxampError):
    """Too many consecutive optimizer steps were skipped for non-finite gradients."""


class InputShapeError(FxampError, ValueError):
    """A rewritten (exported) model was called with another size on a dimension that was
    exported static; the message names the input, the dimension and ``dynamic_shapes=``."""


class InputDtypeError(FxampError, TypeError):
    """A call's input has a dtype autocast treats otherwise than the example's, so the plan
    does not hold for it (an integer, bool or float64 tensor where the example had a low- or
    single-precision float, or another dtype where the example had float64)."""


class CallStructureError(FxampError, TypeError):
    """A rewritten model was called with another structure than its example: an argument
    that was a tensor is None or left out, or the other way round; the message names the
    argument, what the example had and the ``example_kwargs`` to rewrite with."""


class ModeError(FxampError, RuntimeError):
    """A rewritten module was called in a training mode its graph was not traced for (its
    train and eval traces differ and only one could be kept)."""


class StoredWeightsError(FxampError, RuntimeError):
    """A model rewritten with the policy ``weights=stored`` (weights at rest in low
    precision, for inference) was asked to train: a backward, or a forward with grad in
    train mode; the message says to rewrite with ``weights=cast`` for training."""


class NotPlannedError(FxampError):
    """A model rewritten in place without example inputs was asked for its plan before its
    first call planned it."""


class RuleError(FxampError, TypeError):
    """A decision rule given to ``amp_rewrite`` (``rules=``) is not a
    ``fxamp.DecisionRule``, has no valid ``name``, is missing where the policy names it,
    or its ``applies`` / ``decide`` failed or returned something that is no decision; the
    message names the rule, the node and what to do."""


class ExampleInputError(FxampError, ValueError):
    """The FP32 model itself fails on the example inputs (wrong shape, type or count)."""


class CalibrationDataError(FxampError, ValueError):
    """``calibration_data`` is not a non-empty collection of batches the model accepts; the
    message names what was given, the failing batch and node, and what to pass instead."""


class CheckpointError(FxampError, ValueError):
    """A checkpoint does not fit the trainer (another model, optimizer layout or scaler, or
    not a trainer checkpoint at all); nothing was loaded."""


class FactoryError(FxampError):
    """A command's MODULE:FACTORY could not be imported, called, or returned something that
    is not a model or ``(model, example_inputs)``; the message names the cause."""


#: the most characters of a user's input (a line of a file) quoted in a message
EXCERPT_CHARS = 200


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``repr(text)``, cut to its first ``limit`` characters with a note of its length when
    longer, so a message never echoes a huge input whole.

    Args:
        text: the user's input.
        limit: the most characters shown.

    Returns:
        The quoted, possibly cut, text.
    """
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters, the first {limit} shown)"


def shorten(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` unquoted, cut like ``excerpt``.

    Args:
        text: the user's input.
        limit: the most characters shown.

    Returns:
        The possibly cut text.
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters, the first {limit} shown)"


_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (torch,)) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def is_library_file(path: str) -> bool:
    """Whether ``path`` belongs to torch or fxamp (not the user's code).

    Args:
        path: a source file's path.

    Returns:
        True for a file of torch or fxamp.
    """
    return os.path.abspath(path).startswith(_LIBRARY_DIRS)


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies under it.

    Args:
        path: a file's path.

    Returns:
        The relative path, or ``path`` unchanged.
    """
    full, here = os.path.abspath(path), os.getcwd() + os.sep
    return full[len(here):] if full.startswith(here) else path


def source_line(node: torch.fx.Node) -> str:
    """The user's source line that created ``node`` (last frame outside torch and fxamp).

    Args:
        node: a traced node (its ``stack_trace`` is read).

    Returns:
        ``File "...", line N, in f: code``, or ``""`` when the trace names no such frame.
    """
    trace = node.stack_trace or ""
    lines = trace.strip().splitlines()
    best = ""
    for i, line in enumerate(lines):
        line = line.strip()
        path = line[len('File "'):].split('"', 1)[0] if line.startswith('File "') else ""
        if path and not is_library_file(path):
            line = line.replace(path, short_path(path), 1)
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            best = f"{line}: {code}" if code else line
    return best


def node_error(cls: type, node: Optional[torch.fx.Node], problem: str, fix: str) -> FxampError:
    """Build an error of type ``cls`` naming ``node``, its source line and the fix.

    Args:
        cls: the ``FxampError`` subclass to build.
        node: the node the error is about (None: the message names no node).
        problem: what is wrong, one sentence.
        fix: what to do, written after ``what to do:``.

    Returns:
        The error, to raise.
    """
    parts = [problem]
    if node is not None:
        parts.append(f"node: {node.format_node()}")
        where = source_line(node)
        if where:
            parts.append(f"source: {where}")
    parts.append(f"what to do: {fix}")
    return cls("\n  ".join(parts))
