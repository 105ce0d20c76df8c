"""A call's arguments, and the ATen ops a call runs that depend on them.

:func:`arg` reads one argument of an fx call by name, wherever it was passed (the op
vocabulary, :mod:`fxamp.ops`, re-exports it for the passes; the op tables use it for the
ops below). The ops: ``F.interpolate``'s mode, ``F.pad``'s mode and pad length, whether an
``einsum`` contracts an index."""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _torch

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


def _signature(target: Any) -> Optional[inspect.Signature]:
    """The signature of a call target: the ATen schema for an overload, else Python's."""
    if isinstance(target, _torch.OpOverload):
        params = [inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY if a.kwarg_only
                                    else inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for a in _torch.op_schema(target).arguments]
        return inspect.Signature(params)
    try:
        return inspect.signature(inspect.unwrap(target))
    except (TypeError, ValueError):
        return None


def _normalised(node: "torch.fx.Node") -> Optional[Dict[str, Any]]:
    """All the node's arguments by name (a call_function whose target has a signature)."""
    if node.op != "call_function":
        return None
    sig = _signature(node.target)
    if sig is None:
        return None
    try:
        return dict(sig.bind_partial(*node.args, **node.kwargs).arguments)
    except TypeError:
        return None


def arg(node: "torch.fx.Node", key: str, index: Optional[int] = None, default: Any = None) -> Any:
    """The argument ``key`` of the call ``node``, whether passed by keyword or by position.

    ``index`` is its position in the node's own call (for a tensor method, ``self`` is
    position 0). Without ``index`` the position comes from the op's schema (Python
    signature or ATen schema). ``default`` when it was not passed."""
    if key in node.kwargs:
        return node.kwargs[key]
    if index is not None:
        return node.args[index] if len(node.args) > index else default
    bound = _normalised(node)
    if bound is not None:
        return bound.get(key, default)
    return default


#: ``node.meta`` key: the FP32 trace's values of arguments that the graph holds another
#: value for (a dtype read at run time that follows autocast's run, a mask fill written as
#: FP16's lowest), by position (int) or keyword (str): what the FP32 model computes with
FP32_VALUES = "fxamp_fp32_values"


def keep_fp32_values(node: "torch.fx.Node", args: tuple, kwargs: Dict[str, Any]) -> None:
    """Record, before ``node``'s arguments change from ``args`` / ``kwargs`` (its FP32
    ones), each plain value that changes, so FP32 runs of the graph can put it back.

    Args:
        node: the node whose arguments were just changed.
        args: its positional arguments before the change.
        kwargs: its keyword arguments before the change.
    """
    saved = node.meta.setdefault(FP32_VALUES, {})
    changed = [(i, old) for i, (old, new) in enumerate(zip(args, node.args)) if old is not new]
    changed += [(key, old) for key, old in kwargs.items() if node.kwargs.get(key) is not old]
    for key, old in changed:  # (fx rebuilds containers of nodes: those are no values)
        if not _holds_node(old):
            saved.setdefault(key, old)


def _holds_node(value: Any) -> bool:
    """Whether ``value`` is or contains an fx node."""
    if isinstance(value, (tuple, list)):
        return any(_holds_node(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_node(v) for v in value.values())
    return isinstance(value, torch.fx.Node)


def fp32_values(node: "torch.fx.Node", args: tuple, kwargs: Dict[str, Any]
                ) -> Tuple[tuple, Dict[str, Any]]:
    """``args`` / ``kwargs`` of ``node`` (as an interpreter fetched them) with the FP32
    model's own values back (:func:`keep_fp32_values`); unchanged for any other node.

    Args:
        node: the node about to run.
        args: its positional argument values.
        kwargs: its keyword argument values.

    Returns:
        The arguments an FP32 run of the model passes.
    """
    saved = node.meta.get(FP32_VALUES)
    if not saved:
        return args, kwargs
    args = tuple(saved.get(i, a) for i, a in enumerate(args))
    kwargs = {k: saved.get(k, v) for k, v in kwargs.items()}
    return args, kwargs
