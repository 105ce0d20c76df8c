"""Joins pass (rule "joins"): cat / stack / where / index_put fed from branches of different
dtypes get one consistent dtype, the widest, as promote ops.

A join is ``torch.cat`` / ``torch.concat`` / ``torch.concatenate`` / ``torch.stack`` /
``torch.hstack`` / ``torch.vstack`` / ``torch.dstack`` (the tensors of the list),
``torch.where`` / ``Tensor.where`` (the two values; the bool condition is no floating input)
and ``torch.index_put`` / ``Tensor.index_put`` (the destination and the values; the indices
are no floating input), and the ATen overloads a torch.export graph calls for them
(``aten.cat`` / ``aten.stack`` / ..., ``aten.where.self``, ``aten.index_put``). In-place forms
(``index_put_``, ``x[i] = v``) and calls with ``out=`` are left alone. The dtypes of the
floating inputs are read from each input node's plan (``ir.precision(node).dtype``) after
annotate; the widest is ``torch.promote_types`` over them, so fp16 + bf16 gives fp32.

What gets rule "joins" (decided here, recorded in the plan):

* a join that would see mixed dtypes under the current plan: one on no autocast list (CUDA
  cat / stack, ``where`` on both targets, CPU ``index_put``), fed from branches that autocast
  leaves in different dtypes. Its inputs are cast to the widest dtype. For cat, stack and
  where the result equals torch's own type promotion, but the plan now says so; for
  index_put, which requires one dtype, this turns an error into a result;
* a join on autocast's promote list (CPU cat / stack, CUDA index_put) whose promotion
  torch.autocast itself would refuse ("Unexpected floating ScalarType in
  at::autocast::prioritize": e.g. fp16 with bf16 and no fp32 input). It gets the widest dtype.

A join that autocast already promotes to one dtype (CPU cat of fp16 and fp32: the plan
casts every input to fp32) keeps rule "autocast": that is exactly what autocast does, and
the plan's reason already says it runs in the widest dtype. Joins of one dtype are untouched,
and so are nodes a policy override decides (rule "user") or that run under autocast at run
time (rule "runtime").

Limit: the pass reads the dtypes annotate computed before it ran; a fixed index_put whose
output dtype changes is accounted for by the joins that use it directly, other consumers are
re-annotated by the pipeline after the pass.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .. import ir, ops
from ..ir import Decision, Rule
from ..policy import Policy, dtype_name
from . import observe
from .manager import PassContext
from .rule import DecisionRule, rule_pass

log = logging.getLogger(__name__)

RULE = Rule.JOINS

_aten = torch.ops.aten
# fx spellings and the ATen overloads torch.export graphs call (same argument order)
_LIST_JOINS = (torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack,
               torch.vstack, torch.dstack, _aten.cat.default, _aten.concat.default,
               _aten.concatenate.default, _aten.stack.default, _aten.hstack.default,
               _aten.vstack.default, _aten.dstack.default)
_WHERES = (torch.where, _aten.where.self, _aten.where.ScalarSelf, _aten.where.ScalarOther)
_INDEX_PUTS = (torch.index_put, _aten.index_put.default)
_MAX_NAMES = 3


def _kind(node: fx.Node) -> Optional[str]:
    """"list", "where" or "index_put" for a join, else None."""
    if ops.is_call(node, _LIST_JOINS):
        return "list"
    if ops.is_call(node, _WHERES, ("where",)):
        return "where"
    if ops.is_call(node, _INDEX_PUTS, ("index_put",)):
        return "index_put"
    return None


def _operands(node: fx.Node, kind: str) -> List[Any]:
    """The arguments of a join that may be floating tensors, in argument order."""
    if kind == "list":
        tensors = ops.arg(node, "tensors", 0)
        return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    if kind == "where":
        if node.op == "call_method":  # x.where(condition, other)
            return [node.args[0], ops.arg(node, "other", 2)]
        return [ops.arg(node, "input", 1), ops.arg(node, "other", 2)]
    # index_put(input, indices, values, accumulate): the indices are not floating
    return [ops.arg(node, "input", 0), ops.arg(node, "values", 2)]


def _float_inputs(operands: List[Any], changed: Dict[fx.Node, torch.dtype]
                  ) -> List[Tuple[fx.Node, torch.dtype]]:
    """(producer, dtype) of each floating input node (once per node), in argument order."""
    out: List[Tuple[fx.Node, torch.dtype]] = []
    seen = set()
    for arg in operands:
        if not isinstance(arg, fx.Node) or arg in seen:
            continue
        seen.add(arg)
        plan = ir.precision(arg)
        if plan is not None:
            out.append((arg, changed.get(arg, plan.dtype)))
    return out


def _autocast_promotes(dtypes: List[torch.dtype], low: torch.dtype) -> bool:
    """Whether torch.autocast's promote (at::autocast::prioritize, starting from the
    low-precision dtype, fp64 ignored) accepts these input dtypes in this order."""
    current = low
    for d in dtypes:
        if d == torch.float64:
            continue
        if current == torch.float32 or d == torch.float32:
            current = torch.float32
        elif not (current == low and d == low):
            return False
    return True


def _describe(inputs: List[Tuple[fx.Node, torch.dtype]]) -> str:
    """'fp16 (conv) and fp32 (interpolate)'."""
    groups: Dict[torch.dtype, List[str]] = {}
    for producer, dtype in inputs:
        groups.setdefault(dtype, []).append(producer.name)
    parts = []
    for dtype, names in groups.items():
        shown = ", ".join(names[:_MAX_NAMES])
        if len(names) > _MAX_NAMES:
            shown += f", +{len(names) - _MAX_NAMES} more"
        parts.append(f"{dtype_name(dtype)} ({shown})")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _decide(node: fx.Node, kind: str, gm: fx.GraphModule, policy: Policy,
            changed: Dict[fx.Node, torch.dtype]) -> Optional[Tuple[torch.dtype, str]]:
    """(dtype, reason) when the join needs rule "joins", else None."""
    plan = ir.precision(node)
    if plan is None or plan.rule in (Rule.USER, Rule.RUNTIME) or "out" in node.kwargs:
        return None
    inputs = _float_inputs(_operands(node, kind), changed)
    dtypes = [d for _, d in inputs]
    if not dtypes:
        return None
    widest = observe.widest(dtypes)
    # what the join sees under the current plan: its input cast skips fp64, like autocast
    seen = {plan.inputs if plan.inputs is not None and d != torch.float64 else d
            for d in dtypes}
    promote = ops.category(node, gm, policy.target) == ops.PROMOTE
    described = _describe(inputs)
    if len(seen) > 1:
        note = ""
        if kind == "index_put":
            note = " (index_put requires one dtype)"
        return widest, f"joins {described} inputs: promoted to {dtype_name(widest)}{note}"
    if promote and plan.rule == Rule.AUTOCAST and not _autocast_promotes(dtypes, policy.compute):
        verb = "promoted to" if len(set(dtypes)) > 1 else "kept in"
        return widest, (f"joins {described} inputs: {verb} {dtype_name(widest)} "
                        f"(torch.autocast for {policy.target} in {dtype_name(policy.compute)} "
                        f"raises on these dtypes)")
    return None


class JoinsRule(DecisionRule):
    """Joins of mixed dtypes get the widest one (see the module docstring). The rule
    remembers, within one sweep, the joins whose output dtype it changes: a join fed by
    such a join sees the new dtype."""

    name = RULE

    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        super().__init__(gm, ctx)
        self.changed: Dict[fx.Node, torch.dtype] = {}

    def applies(self, node: fx.Node) -> bool:
        return _kind(node) is not None

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        decided = _decide(node, _kind(node), self.gm, self.policy, self.changed)
        if decided is None:
            return {}
        dtype, reason = decided
        log.debug("%s: %s", node.name, reason)
        if ir.precision(node).dtype != dtype:
            self.changed[node] = dtype
        return {node: self.verdict(dtype, reason)}


#: the joins pass: ``(gm, ctx) -> PassResult``
consistent_joins = rule_pass(JoinsRule)
