"""Errors fxamp raises. Each names the node, its source line and what to do."""
from __future__ import annotations

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
    """A plan file is malformed; the message names the line."""


def source_line(node: torch.fx.Node) -> str:
    """The user's source line that created ``node`` (last frame outside torch), or ''."""
    trace = node.stack_trace or ""
    lines = trace.strip().splitlines()
    best = ""
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith("File ") and "/torch/" not in line and "/fxamp/" not in line:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            best = f"{line}: {code}" if code else line
    return best


def node_error(cls: type, node: Optional[torch.fx.Node], problem: str, fix: str) -> FxampError:
    """Build an error of type ``cls`` naming ``node``, its source line and the fix."""
    parts = [problem]
    if node is not None:
        parts.append(f"node: {node.format_node()}")
        where = source_line(node)
        if where:
            parts.append(f"source: {where}")
    parts.append(f"what to do: {fix}")
    return cls("\n  ".join(parts))
