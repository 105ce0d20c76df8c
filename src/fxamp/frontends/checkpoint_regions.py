"""Checkpoint regions of a rewritten graph, run under ``torch.utils.checkpoint.checkpoint``.

The front ends trace a ``checkpoint(fn, *args, **keywords)`` call inline and tag its nodes
(:mod:`.checkpointing`); the passes plan and cast them like any others, so every computing
node of the region is a line of the plan. :func:`outline` (the front ends' ``finish``)
then moves each region's nodes out of the rewritten graph into a :class:`CheckpointRegion`
submodule ``fxamp_checkpoint_<k>`` and calls it in their place. Moved with them: the casts
the region reads (activations' and weights'; copied when read outside too), as
``torch.autocast`` casts inside the checkpointed function, so the region saves what
autocast's saves: its positional arguments for the reentrant variant, nothing for the
non-reentrant one.

At run time the region calls ``checkpoint`` with the keywords of the model's own call
(``use_reentrant``, ``preserve_rng_state``, ``context_fn``, ...) and the same positional
arguments (the nodes of the call's arguments); everything else it reads (weights, the
weight cache, masks computed before it, modules it calls) is bound by closure, as in the
model. The recompute runs the same explicit casts (no autocast needed); a weight's
low-precision copy at recompute (the weight cache's) has the same values and is linked to
its FP32 master, so gradients reach the master through the reentrant recompute and through
the non-reentrant variant's forward graph alike. Without grad, or in a training mode whose
trace made no checkpoint call (HF layers checkpoint in train mode only), the body runs
directly.

Regions inside regions become regions of the outer region's body. The rewritten module's
own graph no longer holds the moved nodes: they are in ``gm.fxamp_checkpoint_<k>.body``
(marked :data:`fxamp.passes.graph_parts.PART`: the audit reads them there).
"""
from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Set

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .. import ir
from ..errors import UnsupportedModelError, node_error
from ..passes import fetch_attr
from ..passes.graph_parts import PART
from ..weight_cache import is_cast_node
from .checkpointing import Region, arg_marks, copy_marks, tags

log = logging.getLogger(__name__)

#: the prefix of the region submodules' names
PREFIX = "fxamp_checkpoint_"


def _run(body: nn.Module, captured: tuple, *args: Any) -> Any:
    return body(*args, *captured)


def call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``: a region body's call of a module it gets as an input."""
    return module(*args, **kwargs)


class CheckpointRegion(nn.Module):
    """One checkpointed region: ``body`` (the region's rewritten nodes) called through
    ``checkpoint(body, *args, **options)``. No parameters or buffers of its own (nothing in
    ``state_dict``): weights, the weight cache and modules come in as inputs. After the
    caller's training flag, the first ``n_args`` inputs are the checkpoint call's positional
    arguments, the rest are bound by closure. ``modes``: the training modes in which the
    model checkpointed."""

    def __init__(self, body: fx.GraphModule, n_args: int, options: Dict[str, Any],
                 modes: Iterable[bool]) -> None:
        super().__init__()
        self.body = body
        self.n_args = n_args
        self.options = dict(options)
        self.modes: FrozenSet[bool] = frozenset(modes)

    def forward(self, training: bool, *values: Any) -> Any:
        """``training``: the flag of the module whose graph calls it (the rewritten root's,
        which ``train()`` / ``eval()`` and an in-place rewrite's model reach)."""
        args, captured = values[:self.n_args], values[self.n_args:]
        self.body.training = training  # (regions nested in the body read it)
        if not torch.is_grad_enabled() or training not in self.modes:
            return self.body(*args, *captured)
        return checkpoint(functools.partial(_run, self.body, captured), *args, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()
                         if k in ("use_reentrant", "preserve_rng_state"))


def outline(gm: fx.GraphModule) -> int:
    """Move each checkpoint region of ``gm``'s graph into a :class:`CheckpointRegion`
    called in its place (nested regions into the outer one's body); the number of regions
    at the top level."""
    return _outline(gm, 0)


def _first_region(graph: fx.Graph, depth: int) -> Optional[Region]:
    for node in graph.nodes:
        found = tags(node)
        if len(found) > depth and node.op not in ("placeholder", "get_attr", "output"):
            return found[depth]
    return None


def _outline(gm: fx.GraphModule, depth: int) -> int:
    count = 0
    while True:
        region = _first_region(gm.graph, depth)
        if region is None:
            break
        _outline_one(gm, region, depth, f"{PREFIX}{count}")
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        log.info("%s: %d checkpoint region(s) kept", type(gm).__name__, count)
    return count


def _in(node: fx.Node, region: Region, depth: int) -> bool:
    found = tags(node)
    return (len(found) > depth and found[depth].id == region.id
            and node.op not in ("placeholder", "get_attr", "output"))


def _members(nodes: List[fx.Node], region: Region, depth: int) -> Set[fx.Node]:
    """The region's tagged nodes, and every node between them that reads one of them and
    is read by one (nodes the passes inserted inside it: a cast of a region value, a fused
    softmax), so that the region is one piece of the graph."""
    members = {n for n in nodes if _in(n, region, depth)}
    index = {n: i for i, n in enumerate(nodes)}
    first, last = min(index[n] for n in members), max(index[n] for n in members)
    span = nodes[first:last + 1]
    while True:
        reads: Set[fx.Node] = set()
        for node in span:
            if node not in members and any(i in members or i in reads
                                           for i in node.all_input_nodes):
                reads.add(node)
        grown = {n for n in reads if any(u in members for u in n.users)}
        if not grown:
            return members
        members |= grown


def _pulled(members: Set[fx.Node]) -> Set[fx.Node]:
    """Casts of values from outside that the region reads (autocast casts inside the
    checkpointed function): copied into the region."""
    pulled: Set[fx.Node] = set()
    inside = set(members)
    changed = True
    while changed:
        changed = False
        for node in list(inside):
            for value in node.all_input_nodes:
                if value not in inside and (ir.is_cast(value) or is_cast_node(value)):
                    pulled.add(value)
                    inside.add(value)
                    changed = True
    return pulled


def _outline_one(gm: fx.GraphModule, region: Region, depth: int, name: str) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    members = _members(nodes, region, depth)
    pulled = _pulled(members)
    body_nodes = [n for n in nodes if n in members or n in pulled]
    inside = set(body_nodes)
    explicit = _explicit_args(nodes, region)
    first = next(n for n in nodes if n in members)
    if region.reentrant and len(explicit) != region.n_args:
        raise node_error(
            UnsupportedModelError, first,
            f"the reentrant checkpoint region starting at {first.name} took "
            f"{region.n_args} traced positional arguments, of which the rewritten graph "
            f"keeps {len(explicit)}: run as is, its recompute could not give their gradients",
            "pass use_reentrant=False to torch.utils.checkpoint.checkpoint (HF: "
            "gradient_checkpointing_kwargs={'use_reentrant': False}), or "
            "frontend='fx' / 'export' (the other tracer)")
    modules: Dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first):
        for node in body_nodes:
            if node.op == "call_module":
                modules[node] = graph.get_attr(str(node.target))
    captured: List[fx.Node] = []
    for node in body_nodes:
        for value in node.all_input_nodes:
            if value not in inside and value not in explicit and value not in captured:
                captured.append(value)
    captured += [m for m in modules.values()]
    outputs = [n for n in body_nodes if n in members
               and any(u not in inside for u in n.users)]
    body = _body(gm, body_nodes, explicit, captured, modules, outputs, depth + 1)
    gm.add_submodule(name, CheckpointRegion(body, len(explicit), region.options,
                                            region.modes))
    _hoist(nodes, members, first)
    with graph.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fx: "no underlying reference"
        flag = graph.get_attr("training")
        call = graph.call_module(name, (flag,) + tuple(explicit) + tuple(captured))
    with graph.inserting_after(call):
        for i, out in reversed(list(enumerate(outputs))):
            item = graph.call_function(_getitem, (call, i))
            item.meta.update({k: v for k, v in out.meta.items() if k != "custom"})
            copy_marks(out, item)  # (the argument of a later region)
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    erased: Set[fx.Node] = set()
    for node in reversed(body_nodes):
        if node in members or not node.users:
            graph.erase_node(node)
            erased.add(node)
    _sink([n for n in pulled if n not in erased], graph)


def _sink(kept: List[fx.Node], graph: fx.Graph) -> None:
    """Move each cast the region copied but others still read down to its first reader
    (it was made where the region first read it). Safe: the casts pass reuses a cast only
    up to the next grad-mode switch or in-place change of its input."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(kept, key=order.__getitem__, reverse=True):
        min(node.users, key=order.__getitem__).prepend(node)


def _shape(gm: fx.GraphModule, node: fx.Node) -> Optional[tuple]:
    """The shape of a region input: the IR's, or a weight's or buffer's own."""
    shape = ir.get(node).shape
    if shape is None and node.op == "get_attr":
        value = fetch_attr(gm, str(node.target))
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    return None if shape is None else tuple(shape)


def _getitem(values: tuple, index: int) -> Any:
    return values[index]


def _explicit_args(nodes: List[fx.Node], region: Region) -> List[fx.Node]:
    """The nodes of the checkpoint call's positional arguments, in order. torch.export
    copies a tensor's meta onto nodes made from it (its ``sym_size``): per position, the
    first node whose value is a tensor (fx graphs record no values)."""
    found: Dict[int, fx.Node] = {}
    for node in nodes:
        value = node.meta.get("val", None)
        if "val" in node.meta and not isinstance(value, torch.Tensor):
            continue
        for rid, position in arg_marks(node):
            if rid == region.id:
                found.setdefault(position, node)
    return [found[p] for p in sorted(found)]


def _hoist(nodes: List[fx.Node], members: Set[fx.Node], first: fx.Node) -> None:
    """Move the nodes between the region's nodes that do not read it before it (their
    order kept); the ones that read it stay after it."""
    start = nodes.index(first)
    last = max(i for i, n in enumerate(nodes) if n in members)
    reads: Set[fx.Node] = set()
    for node in nodes[start:last + 1]:
        if node in members:
            continue
        if any(i in members or i in reads for i in node.all_input_nodes):
            reads.add(node)
        else:
            first.prepend(node)


def _body(gm: fx.GraphModule, body_nodes: List[fx.Node], explicit: List[fx.Node],
          captured: List[fx.Node], modules: Dict[fx.Node, fx.Node], outputs: List[fx.Node],
          depth: int) -> fx.GraphModule:
    """The region's nodes as a graph of their inputs (explicit arguments, then the
    captured values); its nested regions outlined in turn."""
    graph = fx.Graph()
    env: Dict[fx.Node, Any] = {}
    for node in explicit + captured:
        placeholder = graph.placeholder(node.name)
        copy_marks(node, placeholder)
        shape = _shape(gm, node)
        if shape is not None:  # (the audit reads a weight's shape through its input)
            ir.set(placeholder, shape=shape)
        env.setdefault(node, placeholder)
    for node in body_nodes:
        if node.op == "call_module":
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            new = graph.create_node("call_function", call_module,
                                    (env[modules[node]],) + tuple(args), dict(kwargs),
                                    node.name)
            new.meta.update(node.meta)
        else:
            new = graph.node_copy(node, lambda n: env[n])
        env[node] = new
    graph.output(tuple(env[n] for n in outputs))
    body = fx.GraphModule(nn.Module(), graph, "CheckpointBody")
    setattr(body, PART, True)  # (the audit reads its nodes as the rewrite's)
    _outline(body, depth)
    return body
