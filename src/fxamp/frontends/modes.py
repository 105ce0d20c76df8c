"""Train/eval alignment, shared by the fx and the torch.export front ends.

A traced graph bakes Python bools in: ``self.training`` in a custom module, the ``training``
argument of dropout and batch norm. So that ``train()`` / ``eval()`` keep working on the
rewritten module, a front end whose model may read its flag (:func:`reads_training`) captures
the graph in both modes, :func:`align` matches the two graphs node by node, and
:func:`follow_mode` turns the constants that differ into reads of a ``training`` flag. When
the graphs differ in anything else (a branch on ``self.training`` that runs other ops) they
do not align and the front end keeps the current mode's graph, with a warning
(:func:`.common.warn_one_mode`).

One comparison serves both kinds of graph:

- nodes match on ``op`` and ``target``, and on their arguments (nodes through the match,
  everything else by value); ``get_attr`` parameters, buffers and submodules match by
  name, tensor constants by value (fx numbers the constants of two traces with one
  counter, so the same constant has another name in each);
- an ATen call's arguments are read by its schema (defaults filled in), any other node's as
  the flattened ``(args, kwargs)``;
- what may differ: a bool (it becomes the flag or ``not`` the flag), a float that is 0.0 in
  eval mode (dropout's ``p`` in an ATen graph: it becomes ``p * flag``), and nodes only a
  train-mode ATen graph has (batch norm's ``num_batches_tracked.add_(1)``, which becomes
  ``add_(flag)``; identity copies; symbolic-size bookkeeping, which two exports order
  apart). These ATen patterns never occur in an fx graph, so on fx graphs the matching is
  a plain lockstep.

What differs between the front ends is whose flag a constant reads (``flag_of``): an fx graph
keeps the module hierarchy, so a custom module's constant reads that module's own flag
(``gm.block.eval()`` works as on the model); a graph from torch.export keeps only the modules
that hold state (a Dropout is gone), so its constants read the root's flag.
"""
from __future__ import annotations

import functools
import inspect
import io
import operator
import tokenize
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from .._torch import OpOverload, op_schema, tree_flatten, tree_unflatten
from ..ops import fetch_attr


def reads_training(model: nn.Module,
                   traced: Callable[[nn.Module], bool] = lambda module: True) -> bool:
    """Whether a graph traced from ``model`` may depend on its modules' training flags:
    whether the code of any module the front end traces through (``traced(module)``; an
    fx trace keeps torch.nn modules as calls, which read their flag at run time) may read
    ``training``. The source of each torch.nn class (BatchNorm, Dropout...) and the whole
    source file of every other class (its helper functions included) is searched for the
    name ``training`` in code (``self.training``, a ``training=`` argument, the string
    ``"training"``; not comments or docstrings, where "training recipe" says nothing); a
    class whose source cannot be read counts as reading it. Over-approximate on purpose: a
    false "yes" costs one more capture, a false "no" a graph that silently keeps one mode.
    The root's own forward is always traced through (an ``nn.Dropout`` rewritten on its own,
    as a child of an eager root, reads its flag in its code)."""
    return any((m is model or traced(m)) and _class_reads_training(type(m))
               for m in model.modules())


@functools.lru_cache(maxsize=None)
def _class_reads_training(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        try:
            if klass.__module__.startswith("torch.nn."):
                source = inspect.getsource(klass)
            else:
                module = inspect.getmodule(klass)
                source = inspect.getsource(module) if module is not None else None
        except (OSError, TypeError):
            return True
        if source is None or _names_training(source):
            return True
    return False


def _names_training(source: str) -> bool:
    """``source`` has the name ``training`` (or the string "training") in its code."""
    if "training" not in source:
        return False
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and tok.string == "training":
                return True
            if tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").strip("'\"") \
                    == "training":
                return True
    except (tokenize.TokenError, SyntaxError):
        return True
    return False


class Change(NamedTuple):
    """A constant that follows the mode: argument ``index`` of ``train`` (train-mode graph)
    and ``eval`` (eval-mode graph) holds ``train_value`` in train mode (a bool, or a float
    that is 0.0 in eval mode)."""

    train: fx.Node
    eval: fx.Node
    index: int
    train_value: Any


class Alignment:
    """The train-mode graph's nodes matched to the eval-mode graph's, and what differs."""

    def __init__(self) -> None:
        self.match: Dict[fx.Node, fx.Node] = {}  # eval-mode node -> train-mode node
        self.alias: Dict[fx.Node, fx.Node] = {}  # train-only identity -> its input
        self.changes: List[Change] = []
        self.counts: List[fx.Node] = []  # train-only num_batches_tracked += 1

    def resolve(self, node: fx.Node) -> fx.Node:
        while node in self.alias:
            node = self.alias[node]
        return node

    def same_value(self, a: Any, b: Any) -> bool:
        """``a`` (train graph) and ``b`` (eval graph) are the same argument."""
        if _is_size(a) and (_is_size(b) or type(b) is int):
            return True  # sizes do not depend on the mode (the graphs number them apart;
            # the other-mode graph may be static: its sizes are plain ints)
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            return (isinstance(a, fx.Node) and isinstance(b, fx.Node)
                    and self.resolve(a) is self.match.get(b))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(self.same_value(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b

    def compare(self, a: fx.Node, b: fx.Node, roots: Tuple[nn.Module, nn.Module]) -> bool:
        """Match ``a`` (train) with ``b`` (eval) and record the constants that follow the
        mode; nothing is recorded when they do not match."""
        if a.op != b.op:
            return False
        if a.op == "get_attr":
            if not _same_attr(roots[0], str(a.target), roots[1], str(b.target)):
                return False
        elif a.target != b.target:
            return False
        values_a, values_b = node_arguments(a), node_arguments(b)
        if values_a is None or values_b is None or values_a[2] != values_b[2]:
            return False  # (an ATen call's schema, or the (args, kwargs) tree structure)
        changes = []
        for index, (va, vb) in enumerate(zip(values_a[0], values_b[0])):
            if self.same_value(va, vb) or _same_slice_start(a, index, va, vb):
                continue
            change = self.change(a, b, index, va, vb)
            if change is None:
                return False
            changes.append(change)
        self.changes += changes
        self.match[b] = a
        return True

    def skip(self, others: List[fx.Node], j: int) -> int:
        """The index past nodes at ``others[j:]`` (the other graph's) that this graph may
        lack, each matched with what it stands for; ``j`` when there are none (here: never:
        the two modes' graphs have the same nodes).

        Args:
            others: the other graph's nodes, in order.
            j: the first one not matched yet.
        """
        return j

    def change(self, a: fx.Node, b: fx.Node, index: int, va: Any, vb: Any) -> Optional[Any]:
        """The record of argument ``index`` differing, ``va`` in ``a`` (train graph) and
        ``vb`` in ``b`` (eval graph), where such a difference may be followed; None where
        it may not (the graphs do not align). Here: a bool, and a float that is 0.0 in eval
        mode (dropout's ``p``)."""
        if type(va) is bool and type(vb) is bool:
            return Change(a, b, index, va)
        if isinstance(va, float) and (vb is None or (type(vb) in (int, float) and vb == 0)):
            return Change(a, b, index, va)  # dropout p: p in train, 0 in eval
        return None


#: the prefix of the tensor constants a tracer stores on the root (numbered by a counter)
_CONSTANT = "_tensor_constant"


def _same_attr(root_a: nn.Module, target_a: str, root_b: nn.Module, target_b: str) -> bool:
    """Two ``get_attr`` targets name the same value: parameters, buffers and submodules by
    name (the model's own); tensor constants by value (fx numbers the constants of two
    traces apart, so the same constant has another name in each), or by name where they
    hold no values to compare (fake or meta tensors)."""
    if not (target_a.startswith(_CONSTANT) and target_b.startswith(_CONSTANT)):
        return target_a == target_b
    ta, tb = fetch_attr(root_a, target_a), fetch_attr(root_b, target_b)  # (None: missing)
    if not (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)):
        return target_a == target_b
    if ta is tb:
        return True
    if ta.shape != tb.shape or ta.dtype != tb.dtype or ta.device != tb.device:
        return False
    try:
        return bool(torch.equal(ta, tb))
    except Exception:  # noqa: BLE001 - fake / meta tensors: no values
        return target_a == target_b


def _schema_args(node: fx.Node) -> Optional[List[Tuple[str, bool, Any]]]:
    """(name, kwarg_only, value) for every schema argument of an ATen call, defaults filled
    in; None for anything else."""
    fn = node.target
    if node.op != "call_function" or not isinstance(fn, OpOverload):
        return None
    out = []
    for i, arg in enumerate(op_schema(fn).arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            return None
        out.append((arg.name, arg.kwarg_only, value))
    return out


def node_arguments(node: fx.Node
               ) -> Optional[Tuple[List[Any], Callable[[List[Any]], None], Any]]:
    """The node's argument values in order (an ATen call's by its schema, defaults filled
    in; any other node's flattened), a function that writes changed values back, and what
    two nodes' values must share to be compared (the schema's length, the tree's spec)."""
    if isinstance(node.target, OpOverload) and node.op == "call_function":
        schema = _schema_args(node)
        if schema is None:
            return None

        def write_schema(values: List[Any]) -> None:
            node.args = tuple(v for (_, kw, _), v in zip(schema, values) if not kw)
            node.kwargs = {name: v for (name, kw, _), v in zip(schema, values) if kw}

        return [v for _, _, v in schema], write_schema, len(schema)
    flat, spec = tree_flatten((node.args, node.kwargs))

    def write_flat(values: List[Any]) -> None:
        node.args, node.kwargs = tree_unflatten(values, spec)

    return flat, write_flat, spec


#: shape-only nodes that a symbolic export has and a static one has not
_SHAPE_CHECKS = tuple(op for op in (
    getattr(torch.ops.aten, "_assert_scalar", None),
    getattr(torch.ops.aten, "sym_constrain_range_for_size", None),
    getattr(torch.ops.aten, "sym_constrain_range", None)) if op is not None)

#: ATen ops that only the train-mode graph may have and that change no value
_TRAIN_ONLY_IDENTITIES = (torch.ops.aten.contiguous.default, torch.ops.aten.clone.default,
                          torch.ops.aten.alias.default)


def _is_size(value: Any) -> bool:
    """A node computing a symbolic size (``sym_size``, arithmetic on sizes, checks on
    them)."""
    if not isinstance(value, fx.Node):
        return False
    if isinstance(value.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return True
    target = getattr(value.target, "overloadpacket", value.target)
    return value.op == "call_function" and target in _SHAPE_CHECKS


def _is_full_slice(node: fx.Node) -> bool:
    """``x[:]`` along a symbolic dimension (``slice(x, dim, 0, INT64_MAX)``): an identity
    a symbolic export keeps and a static one drops."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    return start in (0, None) and step in (1, None) and (
        end is None or (type(end) is int and end >= 2 ** 62))


def _is_batches_tracked(node: fx.Node) -> bool:
    """``bn.num_batches_tracked.add_(1)``, which only a train-mode ATen graph has."""
    return (node.op == "call_function" and node.target is torch.ops.aten.add_.Tensor
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
            and str(node.args[0].target).endswith("num_batches_tracked"))


def align(train: fx.Graph, eval_: fx.Graph, roots: Tuple[nn.Module, nn.Module],
          aligned: Optional[Alignment] = None) -> Optional[Alignment]:
    """Match the train-mode graph with the eval-mode one (``roots``: the modules their
    ``get_attr`` targets are read from, train's first); None when they differ in more than
    constants that follow the mode, identity ops and batch norm's batch count. Size
    computations are left out of the matching: two exports order them differently.
    ``aligned``: the (empty) alignment to fill, whose :meth:`Alignment.change` says which
    differences may be followed (by default a train/eval :class:`Alignment`)."""
    aligned = Alignment() if aligned is None else aligned
    others = [n for n in eval_.nodes if not _is_size(n)]
    j = 0
    for node in train.nodes:
        if _is_size(node):
            continue
        if j < len(others) and aligned.compare(node, others[j], roots):
            j += 1
        elif _is_batches_tracked(node):
            aligned.counts.append(node)
        elif node.op == "call_function" and node.target in _TRAIN_ONLY_IDENTITIES \
                or _is_full_slice(node):
            aligned.alias[node] = node.args[0]
        else:
            past = _skip_static_aliases(aligned, others, j)
            if past == j:
                past = aligned.skip(others, j)
            if past == j or not aligned.compare(node, others[past], roots):
                return None
            j = past + 1
    return aligned if j == len(others) else None


def _same_slice_start(node: fx.Node, index: int, a: Any, b: Any) -> bool:
    """``x[None:n]`` and ``x[0:n]``: a static export spells the start 0 (``start`` is
    argument 2 of ``aten.slice.Tensor``)."""
    return (node.op == "call_function" and node.target is torch.ops.aten.slice.Tensor
            and index == 2 and a in (None, 0) and b in (None, 0)
            and type(a) is not bool and type(b) is not bool)


def _skip_static_aliases(aligned: Alignment, others: List[fx.Node], j: int) -> int:
    """The index past the ``alias`` nodes at ``others[j:]`` (where a symbolic export slices
    in full, ``x[:, 0:]``, a static one has ``alias(x)``), each matched with what its input
    matched; ``j`` when there are none or only aliases are left."""
    k = j
    while k < len(others) and others[k].op == "call_function" \
            and others[k].target is torch.ops.aten.alias.default \
            and isinstance(others[k].args[0], fx.Node):
        k += 1
    if k == j or k == len(others):
        return j
    for alias in others[j:k]:
        source = aligned.match.get(alias.args[0])
        if source is not None:
            aligned.match[alias] = source
    return k


def root_flag(node: fx.Node) -> str:
    """The flag a constant of a torch.export graph reads: the root's."""
    return ""


def module_flag(node: fx.Node) -> str:
    """The flag a constant of an fx graph reads: the innermost module whose code made it."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def follow_mode(graph: fx.Graph, aligned: Alignment, keep_train: bool,
                flag_of: Callable[[fx.Node], str] = root_flag) -> bool:
    """Make the kept graph (train's when ``keep_train``, else eval's) read the training
    flag (of the module ``flag_of(node)`` names, "" for the root) where the two modes'
    constants differ. False (graph unchanged) when the eval graph is kept but the train
    graph has nodes of its own that must run (batch norm's batch count)."""
    if not keep_train and aligned.counts:
        return False
    for change in aligned.changes:
        node = change.train if keep_train else change.eval
        found = node_arguments(node)
        assert found is not None
        values, write, _ = found
        path = flag_of(node)
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # fx: "no underlying reference"
            flag: Any = graph.get_attr(f"{path}.training" if path else "training")
            if isinstance(change.train_value, bool):
                new: Any = flag if change.train_value else graph.call_function(
                    operator.not_, (flag,))
            else:
                new = graph.call_function(operator.mul, (change.train_value, flag))
        values[change.index] = new
        write(values)
    for node in aligned.counts:  # num_batches_tracked += training (0 in eval mode)
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flag = graph.get_attr(f"{flag_of(node)}.training" if flag_of(node)
                                  else "training")
        node.args = (node.args[0], flag)
    return True
