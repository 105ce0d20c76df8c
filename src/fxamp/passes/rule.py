"""Decision rules: each an object with ``applies(node)`` and ``decide(node)``.

A rule is made for one graph and one rewrite (``Rule(gm, ctx)``), asked ``applies(node)``
for each node in graph order (a cheap filter), and ``decide(node)`` for those it applies
to. ``decide`` returns the decisions it makes — usually for ``node`` alone, sometimes for a
chain around it (a norm's statistics, a hand-written loss) — as ``{node: Decision}``; an
empty dict decides nothing. :func:`rule_pass` turns a rule class into a pass
(``(gm, ctx) -> PassResult``) that records the decisions in the IR (``ir.fix``) with the
rule's name; annotate honours them on its next run. A rule only reads the IR (dtypes,
shapes) and the graph; it never writes either itself, so it can be tested alone.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

import torch
import torch.fx as fx

from .. import ir
from ..ir import Decision, Rule
from . import PassResult
from .manager import Pass, PassContext


class DecisionRule:
    """Base class of the decision rules (see the module docstring)."""

    #: the plan's rule column for what this rule decides
    name: Rule

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "name", None)  # (an abstract base may have none yet)
        if name is not None and not isinstance(name, Rule):
            raise TypeError(f"{cls.__qualname__}.name must be a member of fxamp.ir.Rule "
                            f"(the plan's rule column), not {name!r}")

    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        self.gm, self.ctx, self.policy = gm, ctx, ctx.policy

    def applies(self, node: fx.Node) -> bool:
        """Whether the rule looks at ``node`` (cheap: no decision is made here)."""
        raise NotImplementedError

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        """The decisions for ``node`` (and the nodes it fences along with it)."""
        raise NotImplementedError

    def verdict(self, inputs: Optional[torch.dtype], reason: str) -> Decision:
        """A decision of this rule: ``inputs`` is the dtype the node's inputs are cast to."""
        return Decision(inputs, self.name, reason)


def apply_rule(rule: DecisionRule) -> bool:
    """Ask ``rule`` about every node of its graph; record its decisions. True if any changed."""
    modified = False
    for node in list(rule.gm.graph.nodes):
        if not rule.applies(node):
            continue
        for member, d in rule.decide(node).items():
            modified |= ir.fix(member, d.inputs, d.rule, d.reason)
    return modified


def rule_pass(rule_class: Type[DecisionRule]) -> Pass:
    """The pass that applies a fresh ``rule_class(gm, ctx)`` to the graph."""
    def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(gm, modified=apply_rule(rule_class(gm, ctx)))
    run.__name__ = run.__qualname__ = rule_class.__name__
    run.__doc__ = rule_class.__doc__
    return run
