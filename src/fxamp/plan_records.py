"""The plan's records: what one node computes in (``NodePrecision``) and what it
produced on calibration batches (``RangeStats``).

They sit below both the plan (``fxamp.plan``, which re-exports them) and its text form
(``fxamp.plan_text``, which parses lines into them), so neither imports the other's
module to build one.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import shorten


@dataclass(frozen=True)
class NodePrecision:
    """What one node computes in and why: one line of a ``Plan``.

    Attributes:
        dtype: the node's floating output dtype (the dtype it computes in).
        rule: ``"autocast"`` when it is what ``torch.autocast`` does for the target, else
            the fxamp pass (or ``"user"``, ``"runtime"``) that decided.
        reason: one human sentence.
        op: the torch-level label of its target (``"linear"``, ``"Tensor.softmax"``).
        module: the path of the module it belongs to (``""`` for the root).
        inputs: the dtype its floating inputs are cast to (None: left as they come).
    """

    dtype: torch.dtype
    rule: str
    reason: str
    op: str = ""
    module: str = ""
    inputs: Optional[torch.dtype] = None


@dataclass(frozen=True)
class RangeStats:
    """What one node produced on calibration batches (all its floating outputs)."""

    max_abs: float
    underflow: float  # fraction of non-zero values below the low dtype's smallest normal
    nonfinite: int

    def __str__(self) -> str:
        return (f"max_abs={self.max_abs:.6g} underflow={self.underflow:.4f} "
                f"nonfinite={self.nonfinite}")

    @classmethod
    def parse(cls, text: str) -> "RangeStats":
        """Inverse of ``str``: ``max_abs=... underflow=... nonfinite=...``. Raises
        ValueError unless the three fields are there once each, finite and non-negative
        (``underflow`` a fraction, ``nonfinite`` an integer count)."""
        pairs = [part.split("=", 1) for part in text.split()]
        if any(len(p) != 2 for p in pairs) or \
                sorted(k for k, _ in pairs) != ["max_abs", "nonfinite", "underflow"]:
            raise ValueError("expected max_abs=X underflow=Y nonfinite=Z, each once")
        fields = {k: v for k, v in pairs}
        shown = {k: shorten(v, 40) for k, v in fields.items()}
        try:
            max_abs, underflow = float(fields["max_abs"]), float(fields["underflow"])
        except ValueError:
            raise ValueError(f"max_abs={shown['max_abs']} underflow={shown['underflow']}: "
                             "expected numbers") from None
        for key, value in (("max_abs", max_abs), ("underflow", underflow)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{key}={shown[key]} must be finite and non-negative")
        if underflow > 1:
            raise ValueError(f"underflow={shown['underflow']} is a fraction: at most 1")
        if not re.fullmatch(r"\d{1,18}", fields["nonfinite"]):
            raise ValueError(f"nonfinite={shown['nonfinite']} is a count: a whole number "
                             "from 0, at most 18 digits")
        return cls(max_abs, underflow, int(fields["nonfinite"]))
