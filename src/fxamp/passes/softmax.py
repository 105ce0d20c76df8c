"""Stable softmax pass (rule "softmax"): hand-written exp/sum softmax, log(softmax) and
log(sum(exp)) are replaced by softmax / log_softmax / logsumexp computed in FP32.

This is a graph pass: it runs on the traced source graph before annotation, so it only looks
at the graph's structure. Each recognised pattern becomes ONE node that keeps the name (and
the stack trace / module stack) of the pattern's final node, so plan keys stay stable, and is
fixed to FP32 inputs. The patterns (any mix of the function and method spellings):

* ``exp(x) / exp(x).sum(dim, keepdim=True)`` -> ``torch.softmax(x, dim)``; the numerator and
  the summed exp are the same node or two ``exp`` nodes of the same ``x``; the division is
  ``/``, ``torch.div`` / ``torch.true_divide`` or ``Tensor.div`` / ``Tensor.true_divide``
  without a rounding mode.
* ``log(softmax(x, dim))`` -> ``torch.log_softmax(x, dim)``; the softmax is ``torch.softmax``,
  ``F.softmax``, ``Tensor.softmax`` or an ``nn.Softmax`` module, with an int dim and no dtype.
* ``log(exp(x).sum(dim[, keepdim]))`` -> ``torch.logsumexp(x, dim, keepdim)``.

Only exact patterns are rewritten: one int dim (or a one-element list of it), no ``dtype=`` or
``out=``, ``keepdim=True`` for the division form (without it the broadcast is not a softmax).
Pattern nodes that still have other users are kept; the rest are erased.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..policy import Policy
from . import PassResult
from .. import _torch, ir, ops
from ..ir import Decision, Rule, fix
from .manager import PassContext
from .rule import DecisionRule

log = logging.getLogger(__name__)

RULE = Rule.SOFTMAX

_aten = torch.ops.aten
# torch.export graphs call the ATen overloads, with the same positional arguments
_EXP_FUNCS = (torch.exp, _aten.exp.default)
_LOG_FUNCS = (torch.log, _aten.log.default)
_SUM_FUNCS = (torch.sum, _aten.sum.dim_IntList)
_DIV_FUNCS = (operator.truediv, torch.div, torch.true_divide, _aten.div.Tensor)
_DIV_METHODS = ("div", "true_divide", "__truediv__")
_SOFTMAX_FUNCS = (torch.softmax, F.softmax, torch.special.softmax, _aten.softmax.int)


_is_call = ops.is_call


def _unary_input(node: Any, funcs: Tuple[Callable, ...], method: str) -> Optional[fx.Node]:
    """``x`` when ``node`` is ``fn(x)`` / ``x.method()`` with nothing else passed."""
    if not _is_call(node, funcs, (method,)) or node.kwargs or len(node.args) != 1:
        return None
    arg = node.args[0]
    return arg if isinstance(arg, fx.Node) else None


def _exp_input(node: Any) -> Optional[fx.Node]:
    return _unary_input(node, _EXP_FUNCS, "exp")


def _log_input(node: Any) -> Optional[fx.Node]:
    return _unary_input(node, _LOG_FUNCS, "log")


def _int_dim(dim: Any) -> Optional[int]:
    """A single int dim (a one-element list or tuple counts), else None."""
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, int) and not isinstance(dim, bool):
        return dim
    return None


_bind = ops.bind


def _sum_parts(node: Any) -> Optional[Tuple[fx.Node, int, bool]]:
    """(input, dim, keepdim) when ``node`` is ``sum(input, dim[, keepdim])`` over one int dim
    with no dtype."""
    if not _is_call(node, _SUM_FUNCS, ("sum",)) or not node.args:
        return None
    src = node.args[0]
    bound = _bind(node, ("dim", "keepdim"), ("dim", "keepdim", "dtype"))
    if not isinstance(src, fx.Node) or bound is None or bound.get("dtype") is not None:
        return None
    dim = _int_dim(bound.get("dim"))
    keepdim = bound.get("keepdim", False)
    if dim is None or not isinstance(keepdim, bool):
        return None
    return src, dim, keepdim


def _softmax_parts(node: Any, root: nn.Module) -> Optional[Tuple[fx.Node, int]]:
    """(input, dim) when ``node`` is a softmax over one int dim with no dtype."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        if type(module) is not nn.Softmax or len(node.args) != 1 or node.kwargs:
            return None
        dim = _int_dim(module.dim)
        return (node.args[0], dim) if dim is not None else None
    if not _is_call(node, _SOFTMAX_FUNCS, ("softmax",)):
        return None
    if node.op == "call_function" and node.target is F.softmax:
        bound = _bind(node, ("dim", "_stacklevel", "dtype"), ("dim", "_stacklevel", "dtype"))
    else:
        bound = _bind(node, ("dim", "dtype"), ("dim", "dtype"))
    if bound is None or bound.get("dtype") is not None:
        return None
    dim = _int_dim(bound.get("dim"))
    return (node.args[0], dim) if dim is not None else None


def _div_parts(node: fx.Node) -> Optional[Tuple[Any, Any]]:
    """(numerator, denominator) of a true division."""
    if not _is_call(node, _DIV_FUNCS, _DIV_METHODS) or len(node.args) != 2:
        return None
    if node.kwargs.get("rounding_mode") is not None or set(node.kwargs) - {"rounding_mode"}:
        return None
    return node.args[0], node.args[1]


class _Match:
    """A recognised pattern: the replacement call, the nodes it makes dead, and why."""

    def __init__(self, target: Callable, args: tuple, parts: List[fx.Node], what: str,
                 dim: int) -> None:
        self.target, self.args, self.parts, self.what, self.dim = target, args, parts, what, dim


def _match_softmax(node: fx.Node) -> Optional[_Match]:
    """``exp(x) / exp(x).sum(dim, keepdim=True)``."""
    parts = _div_parts(node)
    if parts is None:
        return None
    num, den = parts
    x = _exp_input(num)
    summed = _sum_parts(den)
    if x is None or summed is None:
        return None
    exp_den, dim, keepdim = summed
    if not keepdim or (exp_den is not num and _exp_input(exp_den) is not x):
        return None
    dead = [den, num] if exp_den is num else [den, exp_den, num]
    return _Match(torch.softmax, (x, dim), dead, "hand-written exp/sum softmax", dim)


def _match_log(node: fx.Node, root: nn.Module) -> Optional[_Match]:
    """``log(softmax(x, dim))`` or ``log(exp(x).sum(dim[, keepdim]))``."""
    inner = _log_input(node)
    if inner is None:
        return None
    soft = _softmax_parts(inner, root)
    if soft is not None:
        x, dim = soft
        return _Match(torch.log_softmax, (x, dim), [inner], "log of softmax", dim)
    summed = _sum_parts(inner)
    if summed is None:
        return None
    exp_node, dim, keepdim = summed
    x = _exp_input(exp_node)
    if x is None:
        return None
    return _Match(torch.logsumexp, (x, dim, keepdim), [inner, exp_node],
                  "hand-written log(sum(exp))", dim)


_NEW_NAMES = {torch.softmax: "softmax", torch.log_softmax: "log_softmax",
              torch.logsumexp: "logsumexp"}


def _why(policy: Policy) -> str:
    if policy.compute == torch.float16:
        return "exp overflows fp16 past 11.1"
    return "bf16 keeps 8 bits of the exp sum"


def _reason(match: _Match, policy: Policy) -> str:
    new = _NEW_NAMES[match.target]
    if match.target is torch.log_softmax:
        why = "the log of a rounded softmax is -inf where it underflows"
    else:
        why = _why(policy)
    return f"{match.what} over dim {match.dim} replaced by {new} in FP32 ({why})"


def _rename(node: fx.Node, name: str) -> None:
    """Give ``node`` the name of an erased node (the graph's namespace keeps that name
    reserved, so fx's own _rename would add a suffix)."""
    graph = node.graph
    if any(n.name == name for n in graph.nodes if n is not node):
        raise RuntimeError(f"fxamp internal error: node name {name!r} is still in use")
    _torch.rename_node(node, name)


def _replace(gm: fx.GraphModule, final: fx.Node, match: _Match) -> fx.Node:
    graph = gm.graph
    with graph.inserting_before(final):
        new = graph.call_function(match.target, match.args)
    ir.copy_foreign_meta(final, new)
    final.replace_all_uses_with(new)
    name = final.name
    graph.erase_node(final)
    _rename(new, name)
    for part in match.parts:  # consumers first: erasing one frees the next
        if not _torch.node_erased(part) and not part.users:
            graph.erase_node(part)
    return new


class SoftmaxRule(DecisionRule):
    """Hand-written softmax, log-softmax and log-sum-exp patterns become the fused call in
    FP32 (a rewrite rule: ``decide`` gives the decision for the pattern's final node,
    ``rewrite`` replaces the pattern by the call, which keeps the node's name)."""

    name = RULE

    def _match(self, node: fx.Node) -> Optional[_Match]:
        if _torch.node_erased(node):
            return None
        return _match_softmax(node) or _match_log(node, self.gm)

    def applies(self, node: fx.Node) -> bool:
        return self._match(node) is not None

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        match = self._match(node)
        assert match is not None
        return {node: self.verdict(torch.float32, _reason(match, self.policy))}

    def rewrite(self, node: fx.Node) -> fx.Node:
        """Replace the pattern ending at ``node``; returns the new call node."""
        match = self._match(node)
        assert match is not None
        return _replace(self.gm, node, match)


def stable_softmax(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite the source graph's hand-written softmax patterns (before annotation)."""
    rule = SoftmaxRule(gm, ctx)
    modified = False
    for node in list(gm.graph.nodes):
        if _torch.node_erased(node) or not rule.applies(node):
            continue
        d = rule.decide(node)[node]
        new = rule.rewrite(node)
        fix(new, d.inputs, d.rule, d.reason)
        log.debug("%s: %s", new.name, d.reason)
        modified = True
    return PassResult(gm, modified=modified)
