"""The op vocabulary: which op an fx node is, and its arguments by name.

Every pass asks this module, whether the graph came from ``torch.fx.symbolic_trace``
(``torch.softmax``, ``F.softmax``, ``x.softmax``, modules) or from ``torch.export``
(``aten.softmax.int``):

* :func:`name` — the bare op name of a call (``"softmax"`` for all four spellings above,
  ``"mul"`` for ``operator.mul`` / ``x.__mul__`` / ``aten.mul.Tensor``);
* :func:`is_call` — whether a node calls one of the given functions (by identity, ATen
  overloads included) or tensor methods;
* :func:`arg` — one argument by name, wherever it came (positional or keyword), normalised
  through the op's schema (``inspect.signature`` for Python functions, the ATen schema for
  overloads) when the caller does not know its position;
* :func:`bind` — the arguments after the first, bound by name, refusing anything unknown;
* :func:`autocast_ops` / :func:`category` — the names autocast's op tables use for the node,
  and the table (lower / fp32 / promote / ...) they are on for a target (``oplists``).
"""
from __future__ import annotations

import inspect
import logging
import operator
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from . import oplists

log = logging.getLogger(__name__)

_MISSING = object()
_CALLS = ("call_function", "call_method")


def name(node: fx.Node) -> str:
    """A call's bare op name (``exp``, ``add``, ``truediv``); "" for modules and non-calls.
    Dunder methods lose their underscores (``__mul__`` -> ``mul``); ATen overloads give their
    op name (``aten.sum.dim_IntList`` -> ``sum``)."""
    bare = oplists.call_name(node)
    if bare.startswith("__") and bare.endswith("__"):
        bare = bare[2:-2]
    return bare


def is_call(node: Any, functions: Sequence[Callable] = (), methods: Sequence[str] = ()) -> bool:
    """Whether ``node`` calls one of ``functions`` (by identity: Python functions and ATen
    overloads alike) or one of the tensor ``methods``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return any(node.target is fn for fn in functions)
    if node.op == "call_method":
        return node.target in methods
    return False


def is_aten(node: fx.Node) -> bool:
    """Whether the node calls an ATen overload (a torch.export graph)."""
    return node.op == "call_function" and oplists.is_aten(node.target)


def label(node: fx.Node, root: nn.Module) -> str:
    """The op label the plan shows (``F.softmax``, ``aten.mm``, ``nn.Linear``)."""
    return oplists.node_ops(node, root)[0]


def autocast_ops(node: fx.Node, root: nn.Module) -> Tuple[str, Optional[Tuple[str, ...]]]:
    """(label, the ATen names autocast's tables use for the node); the names are
    ``oplists.RUNTIME`` for an opaque call autocast decides inside at run time."""
    return oplists.node_ops(node, root)


def category(node: fx.Node, root: nn.Module, target: str) -> Optional[str]:
    """The autocast table (``oplists.LOWER``, ``FP32``, ...) the node is on for ``target``;
    None on no table or for an opaque call."""
    _, ops = oplists.node_ops(node, root)
    if ops is oplists.RUNTIME:
        return None
    return oplists.category_of(ops, target)[0]


def _signature(target: Any) -> Optional[inspect.Signature]:
    """The signature of a call target: the ATen schema for an overload, else Python's."""
    if isinstance(target, torch._ops.OpOverload):
        params = [inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY if a.kwarg_only
                                    else inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for a in target._schema.arguments]
        return inspect.Signature(params)
    try:
        return inspect.signature(inspect.unwrap(target))
    except (TypeError, ValueError):
        return None


def _normalised(node: fx.Node) -> Optional[Dict[str, Any]]:
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


def arg(node: fx.Node, key: str, index: Optional[int] = None, default: Any = None) -> Any:
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


def bind(node: fx.Node, names: Tuple[str, ...], allowed: Tuple[str, ...]
         ) -> Optional[Dict[str, Any]]:
    """The positional arguments after the first bound to ``names``, plus the keywords;
    None if a keyword is not in ``allowed``, is given twice, or there are too many
    positional arguments (a call fxamp does not understand is left alone)."""
    rest = node.args[1:]
    if len(rest) > len(names):
        return None
    bound: Dict[str, Any] = dict(zip(names, rest))
    for key, value in node.kwargs.items():
        if key not in allowed or key in bound:
            return None
        bound[key] = value
    return bound


#: the additions of a graph, fx and ATen spellings
ADDS = (operator.add, torch.add, torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar)
