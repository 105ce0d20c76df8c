"""Decision rules as passes: :func:`rule_pass` (fxamp's own rules) and :func:`user_rules`
(the user's).

A rule (:class:`fxamp.rules.DecisionRule`) is asked ``applies(node)`` for each node in graph
order (a cheap filter), and ``decide(node)`` for those it applies to. ``decide`` returns the
decisions it makes — usually for ``node`` alone, sometimes for a chain around it (a norm's
statistics, a hand-written loss) — as ``{node: Decision}``; an empty dict decides nothing.
:func:`rule_pass` turns a rule class into a pass (``(gm, ctx) -> PassResult``) that records
the decisions in the IR (``ir.fix``) with the rule's name; annotate honours them on its next
run. A rule only reads the IR (dtypes, shapes) and the graph; it never writes either itself,
so it can be tested alone.

A user's rule decides last: fxamp's own rules leave a node a user's rule decided as it is,
and :func:`user_rules` (the ``user_rules`` step, the last of the pass list's ``decide``
group) checks what each user rule returns.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Type

import torch.fx as fx

from .. import ir
from ..errors import FxampError, RuleError, source_line
from ..ops import OP_NODES
from ..ir import Decision
from ..policy import is_user_rule
from ..rules import DECISION_DTYPES, DecisionRule
from . import PassResult
from .manager import Pass, PassContext

__all__ = ["DecisionRule", "apply_rule", "rule_pass", "user_rules"]


def apply_rule(rule: DecisionRule) -> bool:
    """Ask ``rule`` about every node of its graph; record its decisions (a node a user's
    rule decided is left as it is). True if any changed."""
    modified = False
    for node in list(rule.gm.graph.nodes):
        if not rule.applies(node):
            continue
        for member, d in rule.decide(node).items():
            old = ir.fixed(member)
            if old is not None and is_user_rule(old.rule):
                continue
            modified |= ir.fix(member, d.inputs, d.rule, d.reason)
    return modified


def rule_pass(rule_class: Type[DecisionRule]) -> Pass:
    """The pass that applies a fresh ``rule_class(gm, ctx)`` to the graph."""
    def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(gm, modified=apply_rule(rule_class(gm, ctx)))
    run.__name__ = run.__qualname__ = rule_class.__name__
    run.__doc__ = rule_class.__doc__
    return run


def _where(rule: DecisionRule, node: fx.Node) -> str:
    """``rule 'user:x' (KeepScales) at node mul_1 (mul): <source line>``."""
    where = source_line(node)
    line = f"; {where}" if where else ""
    return (f"rule {str(rule.name)!r} ({type(rule).__qualname__}) at node {node.name} "
            f"({node.format_node()}){line}")


def _called(rule: DecisionRule, method: str, node: fx.Node) -> Any:
    """``rule.method(node)``; what it raises becomes a RuleError naming the rule and node."""
    try:
        return getattr(rule, method)(node)
    except FxampError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: named, with its cause
        raise RuleError(f"{_where(rule, node)}: {method}(node) raised {type(err).__name__}: "
                        f"{err}; what to do: fix the rule's {method} (the traceback above "
                        "shows where)") from err


def _checked(rule: DecisionRule, node: fx.Node, decisions: Any) -> Dict[fx.Node, Decision]:
    """``decisions`` (what ``rule.decide(node)`` returned) when each is a decision of
    ``rule`` for an op node of its graph; RuleError naming the first that is not."""
    usage = ("decide(node) returns {node: self.verdict(dtype, reason)} (dtype torch.float32, "
             "torch.float16, torch.bfloat16 or None), or {} to decide nothing")
    if not isinstance(decisions, Mapping):
        raise RuleError(f"{_where(rule, node)}: decide returned {decisions!r} (a "
                        f"{type(decisions).__name__}); what to do: {usage}")
    for member, d in decisions.items():
        if not isinstance(member, fx.Node) or member.graph is not node.graph:
            raise RuleError(f"{_where(rule, node)}: decide returned a decision for "
                            f"{member!r}, which is not a node of this graph; what to do: "
                            f"{usage}")
        if member.op not in OP_NODES:
            raise RuleError(f"{_where(rule, node)}: decide returned a decision for "
                            f"{member.op} node {member.name}; only ops (call_function, "
                            "call_method, call_module) are decided: graph inputs, weights "
                            "and the output keep their dtype; what to do: decide for the "
                            "ops that read it")
        if not isinstance(d, Decision):
            raise RuleError(f"{_where(rule, node)}: decide returned {d!r} for node "
                            f"{member.name}, not a Decision; what to do: {usage}")
        if d.rule != rule.name:
            raise RuleError(f"{_where(rule, node)}: its decision for node {member.name} is "
                            f"named {str(d.rule)!r}, not the rule's own name; what to do: "
                            f"make decisions with self.verdict(dtype, reason)")
        if d.inputs not in DECISION_DTYPES:
            raise RuleError(f"{_where(rule, node)}: its decision for node {member.name} "
                            f"casts inputs to {d.inputs!r}; what to do: {usage}")
        if not isinstance(d.reason, str) or not d.reason.strip():
            raise RuleError(f"{_where(rule, node)}: its decision for node {member.name} has "
                            "no reason; what to do: give one sentence saying why (the plan "
                            "shows it)")
    return dict(decisions)


def user_rules(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """The user's rules (``ctx.rules``), in order, each bound to ``gm`` and asked about
    every op node; a later rule's decision for a node wins over an earlier one's, and all
    win over fxamp's numerics rules (which then leave those nodes alone). A policy
    override (``fp32:PATTERN``) still wins over them (annotate applies it first)."""
    decided: Dict[fx.Node, Decision] = {}
    for given in ctx.rules:
        rule = given.bind(gm, ctx)
        for node in list(gm.graph.nodes):
            if node.op in OP_NODES and _called(rule, "applies", node):
                decided.update(_checked(rule, node, _called(rule, "decide", node)))
    modified = False
    for node, d in decided.items():
        modified |= ir.fix(node, d.inputs, d.rule, d.reason)
    return PassResult(gm, modified)

