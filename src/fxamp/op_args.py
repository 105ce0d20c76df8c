"""ATen ops a call runs that depend on its arguments: ``F.interpolate``'s mode, ``F.pad``'s
mode and pad length, whether an ``einsum`` contracts an index."""
from __future__ import annotations

from typing import Tuple

import torch.nn.functional as F

#: the interpolate functions (their ATen op follows the ``mode`` argument)
INTERPOLATE = {F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear}


def interpolate_ops(mode: str, antialias: bool = False, ndim: int = 4) -> Tuple[str, ...]:
    """ATen ops behind ``F.interpolate`` / ``nn.Upsample`` for a mode."""
    d = max(1, ndim - 2)
    if mode in ("area",):
        return ()
    if mode == "nearest":
        return (f"upsample_nearest{d}d",)
    if mode == "nearest-exact":
        return (f"_upsample_nearest_exact{d}d",)
    name = {"linear": "upsample_linear1d", "bilinear": "upsample_bilinear2d",
            "trilinear": "upsample_trilinear3d", "bicubic": "upsample_bicubic2d"}.get(mode)
    if name is None:
        return ()
    if antialias:
        name = "_" + name + "_aa"
    return (name,)


_PAD_OPS = {("reflect", 1): "reflection_pad1d", ("reflect", 2): "reflection_pad2d",
            ("replicate", 1): "replication_pad1d", ("replicate", 2): "replication_pad2d",
            ("replicate", 3): "replication_pad3d"}


def pad_ops(mode: str, npad: int) -> Tuple[str, ...]:
    """ATen ops behind ``F.pad`` for a mode and a pad list of length ``npad``."""
    name = _PAD_OPS.get((mode, npad // 2))
    return (name,) if name else ()


def einsum_ops(args: tuple) -> Tuple[str, ...]:
    """einsum runs bmm (lowered on CPU too) when it contracts an index of two or more
    operands; otherwise it is elementwise work that follows its inputs (CUDA lists einsum)."""
    if not args or not isinstance(args[0], str):
        return ("einsum", "bmm")
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    equation = args[0].replace(" ", "").replace("...", "")
    lhs, arrow, rhs = equation.partition("->")
    inputs = lhs.split(",")
    letters = [c for term in inputs for c in term]
    out = set(rhs) if arrow else {c for c in letters if letters.count(c) == 1}
    contracted = set(letters) - out
    if len(inputs) >= 2 and len(operands) >= 2 and contracted:
        return ("einsum", "bmm")
    return ("einsum",)
