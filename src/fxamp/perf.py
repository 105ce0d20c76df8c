"""Counting the dtype casts that really dispatch (used by benchmarks/ and the tests).

``count_casts(fn)`` runs ``fn()`` under a ``TorchDispatchMode`` and counts every ATen call that
changes a tensor's dtype: ``aten._to_copy`` (what ``Tensor.to(dtype)``, autocast's casts and
``ToCopyBackward`` dispatch to), plus ``aten.to.*`` / ``prims.convert_element_type`` /
``aten.copy_`` between dtypes in case a backend dispatches those instead. Casts that do not
change the dtype (device moves, plain copies) are not counted.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ._torch import TorchDispatchMode, op_schema

__all__ = ["CastCount", "count_casts"]


@dataclass
class CastCount:
    """Casts seen while ``fn`` ran: totals, bytes written, and a breakdown."""

    n: int = 0
    bytes: int = 0
    #: (op name, source dtype, destination dtype, phase) -> count
    by_kind: Counter = field(default_factory=Counter)
    #: (op name, source dtype, destination dtype, phase) -> bytes
    bytes_by_kind: Counter = field(default_factory=Counter)
    #: (shape, source dtype, destination dtype, phase) -> count (to find repeated casts)
    by_shape: Counter = field(default_factory=Counter)
    #: every op the mode saw, by name (for sanity checks)
    ops: Counter = field(default_factory=Counter)

    def phase(self, phase: str) -> int:
        return sum(c for k, c in self.by_kind.items() if k[3] == phase)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
            torch.float64: "f64"}.get(dtype, str(dtype).replace("torch.", ""))


_CAST_PACKETS = ("aten::_to_copy", "aten::to", "prims::convert_element_type",
                 "aten::_autocast_to_reduced_precision", "aten::_autocast_to_full_precision")


class _CastCounter(TorchDispatchMode):
    def __init__(self, result: CastCount) -> None:
        super().__init__()
        self.result = result
        self.phase = "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple = (),
                           kwargs: Optional[Dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_schema(func).name
        self.result.ops[name] += 1
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        dst: Optional[torch.Tensor] = None
        if name in _CAST_PACKETS and isinstance(out, torch.Tensor):
            dst = out
        elif name == "aten::copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            src, dst = args[1], args[0]
        if src is not None and dst is not None and src.dtype != dst.dtype:
            key = (name.split("::")[-1], _short(src.dtype), _short(dst.dtype), self.phase)
            nbytes = dst.numel() * dst.element_size()
            self.result.n += 1
            self.result.bytes += nbytes
            self.result.by_kind[key] += 1
            self.result.bytes_by_kind[key] += nbytes
            self.result.by_shape[(tuple(dst.shape),) + key[1:]] += 1
        return out


def count_casts(fn: Callable[[], Any], backward: Optional[Callable[[Any], Any]] = None
                ) -> CastCount:
    """Count dtype casts while ``fn()`` runs (phase "forward") and, if given, while
    ``backward(fn_result)`` runs (phase "backward")."""
    result = CastCount()
    mode = _CastCounter(result)
    with mode:
        out = fn()
        if backward is not None:
            mode.phase = "backward"
            backward(out)
    return result
