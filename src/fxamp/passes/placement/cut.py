"""Placement pass: choose the dtype of "follow" ops so that the fewest bytes are cast per step.

Autocast decides every op on its lists; an op on no list ("follow": relu, view, pooling ...)
runs in whatever dtype its inputs come in. That puts a cast wherever a low-precision op reads
an FP32 value, after the follow ops, even when one of them enlarges the tensor (upsample,
repeat, expand + contiguous) and casting before it would move fewer bytes; or before an op
that shrinks it (slicing, pooling) when casting after it would be cheaper.

The choice is a minimum s-t cut (networkx), the principled form of TensorFlow's painting:
source = the low dtype, sink = FP32. Nodes whose dtype is fixed (autocast's lists, the numerics
passes, user overrides, runtime leaves, model inputs and FP32 weights, the output cast) are
tied to their side; free follow ops are variables. A value cast to the other dtype costs its
bytes in that dtype plus, when it needs a gradient, the mirrored cast of the gradient in the
backward; each (value, dtype) is cast once and reused by all consumers, modelled by one
auxiliary node per value and direction. A tiny extra capacity against moving each free node
makes ties keep autocast's choice, and the pass changes nothing unless the bytes cast per step
strictly drop. Changed nodes are recorded with ``ir.fix`` (``rule="placement"``); the
pipeline then propagates the dtypes again.

Free are only follow ops known to behave the same in either dtype (an allowlist): data
movement and selection ops that commute with rounding (view, permute, slicing, repeat, relu,
max pooling, nearest upsampling, zero padding) move either way; arithmetic follow ops (add,
mul, gelu, average pooling ...) only from the low dtype to FP32. Ops whose backward sums
gradients (a gather with a tensor index, expand, repeat, nearest upsampling, overlapping max
pooling) are free only when their value needs no gradient: autocast sums in the dtype the op
runs in, and a sum rounded in the other dtype gives other gradients (a relative-position bias
table gathered by a repeated index, as in BEiT). Never free: ops with a dtype
argument, in-place ops and everything aliasing a value changed in place, modules with
parameters or buffers (BatchNorm: FP32 running statistics), ops with a non-tensor (sequence)
or mixed-dtype input, and ops whose value an FP32 op or the FP32 output reads (they stay FP32,
so that FP32 reads keep their precision). Consumers that depend on a value's dtype (a
comparison, ``x.dtype``, an op that takes its inputs as they come) pin it.

The pass runs whenever ``policy.placement`` is on, with or without the numerics passes;
``placement=off`` reproduces autocast's placement exactly.

This module solves the cut and holds the rule; the allowlist is
:mod:`fxamp.passes.placement.free` and the cut's values, consumers and costs are
:mod:`fxamp.passes.placement.model`.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Set, Tuple

import networkx as nx
import torch
import torch.fx as fx

from ...ir import Decision, Rule
from ...policy import Policy, dtype_name
from ..manager import PassContext
from .model import FP32 as _FP32, CutModel, fmt as _fmt, fp32_locked
from ..rule import DecisionRule, rule_pass

log = logging.getLogger(__name__)

RULE = Rule.PLACEMENT


def _solve(model: CutModel) -> Dict[fx.Node, torch.dtype]:
    """The min-cut assignment of the free nodes (ties broken towards fewest moves)."""
    low = model.low
    scale = len(model.free) + 1  # one unit per moved node breaks ties, never outweighs a byte
    locked = fp32_locked(model)
    free_names = {v.name for v in model.free}
    g = nx.DiGraph()
    src, sink = ("source",), ("sink",)
    g.add_node(src)
    g.add_node(sink)

    def tie(v: fx.Node, dtype: torch.dtype) -> None:
        edge = (src, ("v", v.name)) if dtype == low else (("v", v.name), sink)
        g.add_edge(*edge)
        g.edges[edge].pop("capacity", None)  # no capacity attribute: infinite

    for v in model.relevant:
        dtype = model.values[v]
        var = ("v", v.name)
        g.add_node(var)
        if v not in model.free or v in locked:
            tie(v, dtype)
        elif dtype == low:
            g.add_edge(src, var, capacity=1)  # moving to FP32 costs a tie-break unit
        else:
            g.add_edge(var, sink, capacity=1)
        # ("up", v): v is cast to FP32 somewhere; ("down", v): v is cast to the low dtype
        if dtype == low or v in model.free:
            g.add_edge(var, ("up", v.name), capacity=model.cast_bytes(v, _FP32) * scale)
        if dtype == _FP32 or v in model.free:
            g.add_edge(("down", v.name), var, capacity=model.cast_bytes(v, low) * scale)
        for u in v.users:
            d = model.demand_of(u)
            if d == "free":
                g.add_edge(("up", v.name), ("v", u.name))
                g.add_edge(("v", u.name), ("down", v.name))
            elif d == _FP32:
                g.add_edge(("up", v.name), sink)
            elif d == low:
                g.add_edge(src, ("down", v.name))
            elif d == "pin":
                tie(v, dtype)
    # the graph falls apart into independent pieces once source and sink are set aside;
    # many small cuts are much cheaper than one big one
    source_side: Set[object] = set()
    inner = nx.DiGraph(g)
    inner.remove_nodes_from((src, sink))
    for piece in nx.weakly_connected_components(inner):
        if not any(n[0] == "v" and n[1] in free_names for n in piece):
            continue
        h = nx.DiGraph()
        h.add_nodes_from((src, sink))
        for n in piece:
            h.add_edges_from((n, m, d) for m, d in g.succ[n].items())
            if src in g.pred[n]:
                h.add_edge(src, n, **g.edges[src, n])
        _, (side, _) = nx.minimum_cut(h, src, sink)
        source_side |= side
    return {v: low if ("v", v.name) in source_side else _FP32 for v in model.free}


def _describe(casts: Iterable[Tuple[fx.Node, torch.dtype]], model: CutModel) -> str:
    casts = sorted(casts, key=lambda c: c[0].name)
    if not casts:
        return "nothing"
    names = [f"{v.name} to {dtype_name(d)} ({_fmt(model.cast_bytes(v, d))})"
             for v, d in casts[:3]]
    more = f" and {len(casts) - 3} more" if len(casts) > 3 else ""
    return ", ".join(names) + more


def _groups(moved: List[fx.Node]) -> List[List[fx.Node]]:
    """Moved nodes in connected groups (producer-consumer edges among moved nodes)."""
    g = nx.Graph()
    g.add_nodes_from(moved)
    for n in moved:
        g.add_edges_from((n, a) for a in n.all_input_nodes if a in g)
    return [sorted(c, key=moved.index) for c in nx.connected_components(g)]


def _verdicts(gm: fx.GraphModule, policy: Policy) -> Dict[fx.Node, Tuple[torch.dtype, str]]:
    """The minimum cut's (dtype, reason) for each free node it moves or whose input it
    moved; empty when autocast's placement is already cheapest."""
    model = CutModel(gm, policy)
    if not model.free:
        return {}
    before = {v: model.values[v] for v in model.free}
    old_bytes, old_casts = model.cost(before)
    if old_bytes == 0:  # no cast touches a free node: nothing to gain
        return {}
    after = _solve(model)
    new_bytes, new_casts = model.cost(after)
    if new_bytes >= old_bytes:
        log.debug("placement: autocast's placement is already cheapest (%d bytes)", old_bytes)
        return {}
    log.info("placement: the casts around free ops move %s per step instead of %s",
             _fmt(new_bytes), _fmt(old_bytes))
    moved = [v for v in model.free if after[v] != before[v]]
    verdicts: Dict[fx.Node, Tuple[torch.dtype, str]] = {}
    for group in _groups(moved):
        touched = set(group) | {a for n in group for a in n.all_input_nodes}
        was = {c for c in old_casts if c[0] in touched}
        now = {c for c in new_casts if c[0] in touched}
        saved = sum(model.cast_bytes(*c) for c in was) - sum(model.cast_bytes(*c) for c in now)
        added, removed = now - was, was - now
        how = (f"casting {_describe(added, model)} instead of {_describe(removed, model)}"
               if added else f"reusing casts made anyway instead of casting "
               f"{_describe(removed, model)}")
        for n in group:
            verdicts[n] = (after[n], f"runs in {dtype_name(after[n])} (autocast: "
                           f"{dtype_name(before[n])}): {how} saves {_fmt(saved)} per training "
                           "step (forward and backward)")
    for n in model.free:  # unmoved free nodes whose inputs moved now cast them explicitly
        if after[n] == before[n] and any(after.get(a, model.values.get(a)) != after[n]
                                         for a in n.all_input_nodes if a in model.values):
            moved_in = [a for a in n.all_input_nodes if a in after and after[a] != after[n]]
            verdicts[n] = (after[n], f"stays {dtype_name(after[n])} and casts its input "
                           f"{', '.join(a.name for a in moved_in)}, which placement moved "
                           f"to {dtype_name(after[moved_in[0]]) if moved_in else '?'}")
    return verdicts


class PlacementRule(DecisionRule):
    """Move free follow ops across the low/FP32 boundary where that casts fewer bytes per
    step. The minimum s-t cut is solved once for the graph when the rule is made;
    ``applies`` says whether the cut changes the node, ``decide`` gives its new dtype."""

    name = RULE

    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        super().__init__(gm, ctx)
        self.verdicts = _verdicts(gm, self.policy)

    def applies(self, node: fx.Node) -> bool:
        return node in self.verdicts

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        dtype, reason = self.verdicts[node]
        return {node: self.verdict(dtype, reason)}


#: the placement pass: ``(gm, ctx) -> PassResult``; each change is recorded with
#: ``rule="placement"``
place_casts = rule_pass(PlacementRule)
