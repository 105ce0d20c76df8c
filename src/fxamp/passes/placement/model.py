"""Placement's cut model: the values of a graph, its free nodes, their consumers and the
bytes each cast costs per training step (forward cast plus, for a value that needs a
gradient, the mirrored cast of the gradient in the backward).
"""
from __future__ import annotations

import math
import operator
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from ... import ir, ops
from ...ir import Rule
from ...policy import Policy
from .. import fetch_attr
from ..casts import mutated_source
from .free import ARITH, free_kind, shape_only, sums_gradients

FP32 = torch.float32

def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) \
                else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


class CutModel:
    """The cut model of one graph: values, free nodes, consumers and cast costs."""

    def __init__(self, gm: fx.GraphModule, policy: Policy) -> None:
        self.gm, self.policy, self.low = gm, policy, policy.compute
        nodes = list(gm.graph.nodes)
        #: value nodes in the cut: a floating tensor output in the low dtype or FP32
        self.values: Dict[fx.Node, torch.dtype] = {}
        for n in nodes:
            p, kind = ir.precision(n), ir.get(n).value
            shape = ir.get(n).shape
            if p is not None and kind == "tensor" and p.dtype in (self.low, FP32) \
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
        parameter or on a low-precision model input (an activation: the graph of a child of a
        rewritten model). FP32 model inputs are taken not to."""
        grad: Set[fx.Node] = set()
        for n in nodes:
            if n not in self.values:
                continue
            if n.op == "placeholder":
                if self.values[n] == self.low:
                    grad.add(n)
            elif n.op == "get_attr":
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
        if n not in self.values or n.op not in ops.OP_NODES:
            return None
        p = ir.precision(n)
        if p.rule != Rule.AUTOCAST or p.inputs is not None or ir.fixed(n) is not None:
            return None
        if ops.category(n, self.gm, self.policy.target) != ops.FOLLOW:
            return None  # on an autocast list, or an opaque call
        kind = free_kind(n, self.gm)
        if kind is None:
            return None
        if n in self.grad and sums_gradients(n, self.gm):
            return None  # its backward sums gradients: in autocast's dtype, as autocast does
        floating = [a for a in n.all_input_nodes if ir.precision(a) is not None]
        if not floating or floating[0] not in self.values:
            return None
        if ops.is_call(n, (operator.getitem,), ("__getitem__",)):
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
            changed = mutated_source(n, self.gm) if n.op != "output" else None
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
            out += self.numel(n) * _itemsize(FP32 if to == self.low else self.low)
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
            return out if out in (self.low, FP32) else "pin"
        if u in self.free:
            return "free"
        p = ir.precision(u)
        if p is not None and p.rule != Rule.RUNTIME and p.inputs in (self.low, FP32) \
                and not self._promotes(u):
            return p.inputs
        if shape_only(u):
            return "shape"
        return "pin"

    def _promotes(self, u: fx.Node) -> bool:
        """An op on autocast's promote list: its dtype is the widest of its inputs', so it
        pins them (moving one would change it)."""
        if ir.precision(u).rule != Rule.AUTOCAST or u.op not in ("call_function", "call_method",
                                                           "call_module"):
            return False
        return ops.category(u, self.gm, self.policy.target) == ops.PROMOTE

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


def fp32_locked(model: CutModel) -> Set[fx.Node]:
    """Free FP32 nodes an FP32 op (or the FP32 output) reads, directly or through other free
    nodes: they stay FP32 so that the read keeps its precision."""
    locked: Set[fx.Node] = set()
    stack = [v for v in model.free if model.values[v] == FP32 and any(
        model.demand_of(u) == FP32 for u in v.users)]
    while stack:
        v = stack.pop()
        if v in locked:
            continue
        locked.add(v)
        stack.extend(a for a in v.all_input_nodes if a in model.free)
    return locked
