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
mul, gelu, average pooling ...) only from the low dtype to FP32. Never free: ops with a dtype
argument, in-place ops and everything aliasing a value changed in place, modules with
parameters or buffers (BatchNorm: FP32 running statistics), ops with a non-tensor (sequence)
or mixed-dtype input, and ops whose value an FP32 op or the FP32 output reads (they stay FP32,
so that FP32 reads keep their precision). Consumers that depend on a value's dtype (a
comparison, ``x.dtype``, an op that takes its inputs as they come) pin it.

The pass runs whenever ``policy.placement`` is on, with or without the numerics passes;
``placement=off`` reproduces autocast's placement exactly.
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Dict, Iterable, List, Optional, Set, Tuple

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .. import ir, oplists, ops
from ..ir import Decision, Rule
from ..policy import Policy, dtype_name
from . import fetch_attr
from .casts import _mutated
from .manager import PassContext
from .rule import DecisionRule, rule_pass

log = logging.getLogger(__name__)

RULE = Rule.PLACEMENT
_FP32 = torch.float32

# -- which follow ops are free ----------------------------------------------------------
#: commute with rounding: the same result whichever side of them the cast is
_EXACT_METHODS = {"view", "reshape", "flatten", "permute", "transpose", "t", "contiguous",
                  "expand", "repeat", "squeeze", "unsqueeze", "narrow", "select", "flip",
                  "roll", "clone", "relu", "movedim", "__getitem__", "__neg__", "neg", "abs"}
_EXACT_FUNCTIONS = {torch.flatten, torch.reshape, torch.permute, torch.transpose,
                    torch.squeeze, torch.unsqueeze, torch.narrow, torch.select, torch.flip,
                    torch.roll, torch.clone, torch.movedim, torch.relu, F.relu, F.relu6,
                    operator.getitem, operator.neg, torch.neg, torch.abs, F.max_pool1d,
                    F.max_pool2d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
                    F.pixel_shuffle, F.pixel_unshuffle, F.interpolate, F.pad}
_EXACT_MODULES = (nn.ReLU, nn.ReLU6, nn.MaxPool1d, nn.MaxPool2d, nn.AdaptiveMaxPool1d,
                  nn.AdaptiveMaxPool2d, nn.Flatten, nn.Unflatten, nn.Identity, nn.Upsample,
                  nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d,
                  nn.PixelShuffle, nn.PixelUnshuffle)
#: arithmetic: rounding before them differs from rounding after, so they only move to FP32
_ARITH_METHODS = {"add", "sub", "mul", "__add__", "__sub__", "__mul__", "__radd__",
                  "__rmul__", "mean", "sigmoid", "tanh"}
_ARITH_FUNCTIONS = {operator.add, operator.sub, operator.mul, torch.add, torch.sub, torch.mul,
                    torch.mean, torch.sigmoid, torch.tanh, F.gelu, F.silu, F.hardswish,
                    F.hardsigmoid, F.leaky_relu, F.avg_pool1d, F.avg_pool2d,
                    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d}
_ARITH_MODULES = (nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid,
                  nn.LeakyReLU, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
                  nn.AdaptiveAvgPool2d)
#: consumers that read only a value's shape (its dtype may change under them)
_SHAPE_ATTRS = {"shape", "ndim", "device"}
_SHAPE_METHODS = {"size", "dim", "numel", "ndimension"}

EXACT, ARITH = "exact", "arith"


def _kind_of(node: fx.Node, root: nn.Module) -> Optional[str]:
    """EXACT or ARITH for an allowlisted call whose arguments keep it dtype-agnostic."""
    args, kwargs = node.args, node.kwargs
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        cls = type(module)
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            return None
        if getattr(module, "inplace", False) or getattr(module, "return_indices", False):
            return None
        if cls is nn.Upsample and module.mode not in ("nearest", "nearest-exact"):
            return None
        if cls in (nn.ConstantPad1d, nn.ConstantPad2d) and module.value != 0:
            return None
        if cls in _EXACT_MODULES:
            return EXACT
        return ARITH if cls in _ARITH_MODULES else None
    if node.op == "call_method":
        name = str(node.target)
        kind = EXACT if name in _EXACT_METHODS else ARITH if name in _ARITH_METHODS else None
    elif node.op == "call_function":
        try:
            kind = (EXACT if node.target in _EXACT_FUNCTIONS else
                    ARITH if node.target in _ARITH_FUNCTIONS else None)
        except TypeError:  # unhashable target
            return None
        if node.target is F.interpolate:
            mode = ops.arg(node, "mode", 3, "nearest")
            if mode not in ("nearest", "nearest-exact"):
                return None
        if node.target is F.pad:
            mode = ops.arg(node, "mode", 2, "constant")
            value = ops.arg(node, "value", 3)
            if mode != "constant" or value not in (None, 0, 0.0):
                return None
    else:
        return None
    if kind is None or kwargs.get("inplace") or kwargs.get("return_indices") \
            or kwargs.get("out") is not None:
        return None
    if any(a is True for a in args[1:]):  # positional inplace / return_indices / ...
        return None
    if "dtype" in kwargs or any(isinstance(a, torch.dtype) for a in _flat(args)):
        return None
    return kind


def _flat(value: object) -> List[object]:
    out: List[object] = []
    fx.node.map_aggregate(value, out.append)
    return out


def _shape_only(user: fx.Node) -> bool:
    """A consumer that reads only the shape/device of its input."""
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) > 1 and user.args[1] in _SHAPE_ATTRS
    return user.op == "call_method" and str(user.target) in _SHAPE_METHODS


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) \
                else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


class _Model:
    """The cut model of one graph: values, free nodes, consumers and cast costs."""

    def __init__(self, gm: fx.GraphModule, policy: Policy) -> None:
        self.gm, self.policy, self.low = gm, policy, policy.compute
        nodes = list(gm.graph.nodes)
        #: value nodes in the cut: a floating tensor output in the low dtype or FP32
        self.values: Dict[fx.Node, torch.dtype] = {}
        for n in nodes:
            p, kind = ir.precision(n), ir.get(n).value
            shape = ir.get(n).shape
            if p is not None and kind == "tensor" and p.dtype in (self.low, _FP32) \
                    and shape is not None and all(type(d) is int for d in shape):
                self.values[n] = p.dtype
        self.grad = self._requires_grad(nodes)
        self.free: Dict[fx.Node, str] = {}
        for n in nodes:
            kind = self._free_kind(n)
            if kind is not None:
                self.free[n] = kind
        for n in self._aliased(nodes):
            self.free.pop(n, None)
        #: the values whose casts can change: free ones and the inputs of free ones (the
        #: casts of all others are the same whatever the free nodes do)
        self.relevant = [v for v in self.values
                         if v in self.free or any(u in self.free for u in v.users)]
        self._demand: Dict[fx.Node, object] = {}

    # -- which nodes --------------------------------------------------------------------
    def _requires_grad(self, nodes: Iterable[fx.Node]) -> Set[fx.Node]:
        """Values that (probably) need a gradient: those that depend on a trainable
        parameter. Model inputs are taken not to."""
        grad: Set[fx.Node] = set()
        for n in nodes:
            if n not in self.values:
                continue
            if n.op == "get_attr":
                t = fetch_attr(self.gm, str(n.target))
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    grad.add(n)
            elif n.op == "call_module" and any(
                    p.requires_grad for p in self.gm.get_submodule(str(n.target)).parameters()):
                grad.add(n)
            elif any(a in grad for a in n.all_input_nodes):
                grad.add(n)
        return grad

    def _free_kind(self, n: fx.Node) -> Optional[str]:
        if n not in self.values or n.op not in ("call_function", "call_method", "call_module"):
            return None
        p = ir.precision(n)
        if p.rule != Rule.AUTOCAST or p.inputs is not None or ir.fixed(n) is not None:
            return None
        _, ops = oplists.node_ops(n, self.gm)
        if ops is oplists.RUNTIME or oplists.category_of(ops, self.policy.target)[0] \
                != oplists.FOLLOW:
            return None
        kind = _kind_of(n, self.gm)
        if kind is None:
            return None
        floating = [a for a in n.all_input_nodes if ir.precision(a) is not None]
        if not floating or floating[0] not in self.values:
            return None
        if n.op == "call_function" and n.target is operator.getitem or \
                n.op == "call_method" and n.target == "__getitem__":
            if floating != [n.args[0]]:  # only the indexed tensor may be floating
                return None
        # every floating input a tensor in the node's own dtype (no type promotion to undo)
        if any(a not in self.values or self.values[a] != self.values[n] for a in floating):
            return None
        if kind == ARITH and self.values[n] != self.low:
            return None  # arithmetic only moves from the low dtype to FP32
        return kind

    def _aliased(self, nodes: List[fx.Node]) -> Set[fx.Node]:
        """Free candidates connected (through other candidates) to an in-place op or a value
        it changes: moving them would break the aliasing the mutation relies on."""
        mutated = set()
        for n in nodes:
            changed = _mutated(n, self.gm) if n.op != "output" else None
            if changed is not None:
                mutated.update((n, changed))
        stack = list(mutated)
        seen = set(stack)
        while stack:
            n = stack.pop()
            for m in list(n.all_input_nodes) + list(n.users):
                if m in self.free and m not in seen:
                    seen.add(m)
                    stack.append(m)
        return seen

    # -- costs --------------------------------------------------------------------------
    def numel(self, n: fx.Node) -> int:
        return int(math.prod(ir.get(n).shape))

    def cast_bytes(self, n: fx.Node, to: torch.dtype) -> int:
        """Bytes per step of casting value ``n`` (in the other dtype) to ``to``: the forward
        cast writes it in ``to``; if it needs a gradient, the backward casts the gradient
        back to the other dtype."""
        out = self.numel(n) * _itemsize(to)
        if n in self.grad:
            out += self.numel(n) * _itemsize(_FP32 if to == self.low else self.low)
        return out

    def demands(self, v: fx.Node, assign: Dict[fx.Node, torch.dtype]) -> Set[torch.dtype]:
        """The dtypes ``v``'s consumers cast it to under ``assign`` (free node -> dtype)."""
        out: Set[torch.dtype] = set()
        for u in v.users:
            d = self.demand_of(u)
            if d == "free":
                out.add(assign[u])
            elif isinstance(d, torch.dtype):
                out.add(d)
        return out

    def demand_of(self, u: fx.Node) -> object:
        """What consumer ``u`` does with its floating inputs: "free" (its own variable),
        a dtype (it casts them), "shape" (reads the shape only) or "pin" (takes them as
        they come: their dtype must not change)."""
        if u not in self._demand:
            self._demand[u] = self._demand_of(u)
        return self._demand[u]

    def _demand_of(self, u: fx.Node) -> object:
        if u.op == "output":
            out = self.policy.output_dtype
            return out if out in (self.low, _FP32) else "pin"
        if u in self.free:
            return "free"
        p = ir.precision(u)
        if p is not None and p.rule != Rule.RUNTIME and p.inputs in (self.low, _FP32) \
                and not self._promotes(u):
            return p.inputs
        if _shape_only(u):
            return "shape"
        return "pin"

    def _promotes(self, u: fx.Node) -> bool:
        """An op on autocast's promote list: its dtype is the widest of its inputs', so it
        pins them (moving one would change it)."""
        if ir.precision(u).rule != Rule.AUTOCAST or u.op not in ("call_function", "call_method",
                                                           "call_module"):
            return False
        _, ops = oplists.node_ops(u, self.gm)
        return ops is not oplists.RUNTIME and \
            oplists.category_of(ops, self.policy.target)[0] == oplists.PROMOTE

    def cost(self, assign: Dict[fx.Node, torch.dtype]
             ) -> Tuple[int, Set[Tuple[fx.Node, torch.dtype]]]:
        """Bytes cast per step and the (value, dtype) casts made, with free nodes in
        ``assign``'s dtypes (fixed ones as planned), counting the relevant values only."""
        total, casts = 0, set()
        for v in self.relevant:
            own = assign.get(v, self.values[v])
            for d in self.demands(v, assign):
                if d != own:
                    casts.add((v, d))
                    total += self.cast_bytes(v, d)
        return total, casts


def _fp32_locked(model: _Model) -> Set[fx.Node]:
    """Free FP32 nodes an FP32 op (or the FP32 output) reads, directly or through other free
    nodes: they stay FP32 so that the read keeps its precision."""
    locked: Set[fx.Node] = set()
    stack = [v for v in model.free if model.values[v] == _FP32 and any(
        model.demand_of(u) == _FP32 for u in v.users)]
    while stack:
        v = stack.pop()
        if v in locked:
            continue
        locked.add(v)
        stack.extend(a for a in v.all_input_nodes if a in model.free)
    return locked


def _solve(model: _Model) -> Dict[fx.Node, torch.dtype]:
    """The min-cut assignment of the free nodes (ties broken towards fewest moves)."""
    low = model.low
    scale = len(model.free) + 1  # one unit per moved node breaks ties, never outweighs a byte
    locked = _fp32_locked(model)
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


def _describe(casts: Iterable[Tuple[fx.Node, torch.dtype]], model: _Model) -> str:
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
    model = _Model(gm, policy)
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
