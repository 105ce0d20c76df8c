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
  overloads) when the caller does not know its position; :func:`schema_arg` — an ATen
  op's argument by name, with the schema's default;
* :func:`bind` — the arguments after the first, bound by name, refusing anything unknown;
* :func:`autocast_ops` / :func:`category` / :func:`autocast_entry` — the names autocast's
  op tables use for the node, and the table (:data:`LOWER` / :data:`FP32` / :data:`PROMOTE`
  / ...) they are on for a target; :func:`is_runtime` for an opaque call;
* :func:`module_of` / :func:`is_module` / :func:`module_ops` — the module a ``call_module``
  node calls and what it runs; :func:`fetch_attr` — the value a ``get_attr`` target names;
  :func:`is_loss` — a torch loss in any spelling;
* :func:`label` / :func:`module_label` / :func:`callable_label` / :func:`aten_name` — the
  labels plans and findings show.

The tables themselves (autocast's op lists, torch function / method / module -> ATen names,
the losses) are data in :mod:`fxamp.oplists`; only this module reads them
(``tests/test_layers.py::test_only_the_vocabulary_reads_the_op_tables``).
"""
from __future__ import annotations

import logging
import operator
from collections.abc import Set as AbstractSet
from typing import Any, Callable, Collection, Dict, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from . import oplists
from . import _torch
from .op_args import arg

log = logging.getLogger(__name__)

_MISSING = object()
_CALLS = ("call_function", "call_method")
#: the ``op`` of the nodes that compute (calls of functions, methods and modules): the ones a
#: plan decides
OP_NODES = ("call_function", "call_method", "call_module")


#: autocast's tables (the category of :func:`category`): low dtype, fp32, fp32 unless a dtype
#: is given, widest input, refused, on no list (follows its inputs)
LOWER, FP32, FP32_OPT, PROMOTE, BANNED, FOLLOW = (oplists.LOWER, oplists.FP32,
                                                  oplists.FP32_OPT, oplists.PROMOTE,
                                                  oplists.BANNED, oplists.FOLLOW)
#: the op names of an opaque call (:func:`autocast_ops`): autocast decides inside at run time
RUNTIME = oplists.RUNTIME
#: the tensor methods that are the model's own dtype conversions (``to``, ``float``,
#: ``type_as``...)
CONVERSION_METHODS = oplists.CONVERSION_METHODS


def name(node: fx.Node) -> str:
    """A call's bare op name (``exp``, ``add``, ``truediv``); "" for modules and non-calls.
    Dunder methods lose their underscores (``__mul__`` -> ``mul``); ATen overloads give their
    op name (``aten.sum.dim_IntList`` -> ``sum``)."""
    bare = oplists.call_name(node)
    if bare.startswith("__") and bare.endswith("__"):
        bare = bare[2:-2]
    return bare


def is_call(node: Any, functions: Collection[Callable] = (),
            methods: Collection[str] = ()) -> bool:
    """Whether ``node`` calls one of ``functions`` (by identity: Python functions and ATen
    overloads alike; a set is looked up by hash) or one of the tensor ``methods``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        if isinstance(functions, AbstractSet):
            try:
                return node.target in functions
            except TypeError:  # an unhashable target
                return False
        return any(node.target is fn for fn in functions)
    if node.op == "call_method":
        return node.target in methods
    return False


def is_aten(node: fx.Node) -> bool:
    """Whether the node calls an ATen overload (a torch.export graph)."""
    return node.op == "call_function" and oplists.is_aten(node.target)


def aten_name(node: fx.Node) -> str:
    """``pow.Tensor_Scalar`` / ``linear`` for a node calling an ATen overload (``default``
    dropped); "" for any other node."""
    return oplists.aten_name(node.target) if is_aten(node) else ""  # type: ignore[arg-type]


def fetch_attr(root: Any, target: str) -> Any:
    """The value a dotted ``get_attr`` target names, or None where a part is missing.

    The one dotted-attribute getter: the passes (``fxamp.passes.fetch_attr``), the structure
    check, the mode comparison and the cast builder all read targets through it.

    Args:
        root: the module (or any object) the target is relative to.
        target: a dotted path such as ``"layer1.0.conv1.weight"``.

    Returns:
        The attribute, or None when any part of the path is missing (or None).
    """
    value = root
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def module_of(node: fx.Node, root: nn.Module) -> Optional[nn.Module]:
    """The module a ``call_module`` node calls; None for other nodes."""
    if node.op != "call_module":
        return None
    return root.get_submodule(str(node.target))


def is_module(node: Any, root: nn.Module, classes: Union[type, Tuple[type, ...]]) -> bool:
    """Whether ``node`` calls a module that is an instance of ``classes``."""
    if not isinstance(node, fx.Node):
        return False
    module = module_of(node, root)
    return module is not None and isinstance(module, classes)


def module_ops(module: nn.Module) -> Tuple[str, ...]:
    """The ATen names autocast's tables use for a torch.nn module's class (() when unknown)."""
    return tuple(oplists.MODULE_OPS.get(type(module), ()))


def module_label(module: nn.Module) -> str:
    """``nn.Linear`` for torch.nn modules, else the class's module and qualified name."""
    return oplists.module_label(module)


def callable_label(fn: object) -> str:
    """A short stable label for a call target: ``F.softmax``, ``torch.cat``, ``aten.mm``,
    ``Tensor.exp`` for a method name."""
    return oplists.callable_label(fn)


def is_loss(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` is a torch loss: an ``nn.*Loss`` module, an ``F.*`` loss function or
    the ATen loss op of a torch.export graph (any overload)."""
    if node.op == "call_module":
        return is_module(node, root, oplists.LOSS_MODULES)
    if node.op != "call_function":
        return False
    if is_aten(node):
        return name(node) in oplists.ATEN_LOSSES
    return is_call(node, oplists.LOSS_FUNCTIONS)


def label(node: fx.Node, root: nn.Module) -> str:
    """The op label the plan shows (``F.softmax``, ``aten.mm``, ``nn.Linear``)."""
    return oplists.node_ops(node, root)[0]


def autocast_ops(node: fx.Node, root: nn.Module) -> Tuple[str, Optional[Tuple[str, ...]]]:
    """(label, the ATen names autocast's tables use for the node); the names are
    ``oplists.RUNTIME`` for an opaque call autocast decides inside at run time."""
    return oplists.node_ops(node, root)


def is_runtime(node: fx.Node, root: nn.Module) -> bool:
    """Whether the node is an opaque call (a module or function fxamp cannot see into) whose
    precision torch.autocast decides inside it at run time."""
    return oplists.node_ops(node, root)[1] is oplists.RUNTIME


def category(node: fx.Node, root: nn.Module, target: str) -> Optional[str]:
    """The autocast table (:data:`LOWER`, :data:`FP32`, ... :data:`FOLLOW` on no table) the
    node is on for ``target``; None for an opaque call."""
    _, ops = oplists.node_ops(node, root)
    if ops is oplists.RUNTIME:
        return None
    return oplists.category_of(ops, target)[0]


def autocast_entry(node: fx.Node, root: nn.Module, target: str
                   ) -> Tuple[str, Optional[str], str]:
    """(category, the op name that decides it, the node's label) for ``target``; an opaque
    call is (:data:`FOLLOW`, None, label) — ask :func:`is_runtime` first."""
    label_, ops = oplists.node_ops(node, root)
    category_, op = oplists.category_of(ops or (), target)
    return category_, op, label_


def aten_category(op: str, target: str) -> Optional[str]:
    """The autocast table an ATen op name (``"binary_cross_entropy"``) is on for ``target``;
    None on none."""
    return oplists.aten_category(op, target)


def fp32_list_ops(target: str) -> Tuple[str, ...]:
    """The ATen op names on autocast's fp32 and fp32-unless-a-dtype tables for ``target``."""
    return tuple(op for op, category in oplists.ATEN_TABLES[target].items()
                 if category in (FP32, FP32_OPT))


def schema_arg(node: fx.Node, keys: Tuple[str, ...]) -> Tuple[Optional[str], Any]:
    """(name, value) of the first argument in the ATen op's schema named one of ``keys``
    (``("eps", "epsilon")``): passed by position or keyword, else the schema's default;
    (None, None) when the node calls no ATen overload or its schema has none of them."""
    if not is_aten(node):
        return None, None
    for index, argument in enumerate(_torch.op_schema(node.target).arguments):
        if argument.name in keys:
            return argument.name, arg(node, argument.name, index, argument.default_value)
    return None, None


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


def engine_fp32_op(aten: str, target: str) -> Optional[str]:
    """The ONNX op that ATen op ``aten`` exports to when deployment target ``target`` has no
    FP16 kernel for it (``oplists.ENGINE_FP32_OPS``), else None."""
    return oplists.ENGINE_FP32_OPS.get(target, {}).get(aten.split(".")[0])


def is_reduction(aten: str) -> bool:
    """Whether ATen op ``aten`` sums (or multiplies) many values into one (sum, mean, var...)."""
    return aten.split(".")[0] in oplists.REDUCTION_OPS


def is_conversion(node: fx.Node) -> bool:
    """Whether ``node`` is the model's own dtype conversion (``x.float()``, ``x.to(d)``)."""
    return node.op == "call_method" and node.target in oplists.CONVERSION_METHODS


def moves_values(node: fx.Node) -> bool:
    """Whether a call moves values without computing new ones (getitem, view, split...)."""
    name = (str(node.target) if node.op == "call_method"
            else getattr(node.target, "__name__", ""))
    return name.split(".")[0] in oplists.MOVE_OPS
