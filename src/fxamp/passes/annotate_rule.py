"""The base of annotate's rules: :class:`AnnotateRule`, a decision rule asked during the fake
run, with the node's input values.

Autocast's rules (:mod:`.autocast_rules`) and the deployment rule (:mod:`.deploy`) both
build on it, and ``autocast_rules.make_rules`` picks between them.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.fx as fx

from ..ir import Decision
from .rule import DecisionRule


class AnnotateRule(DecisionRule):
    """A rule annotate asks during the fake run (``decide`` gets the input values)."""

    def decide(self, node: fx.Node, args: tuple = (), kwargs: Optional[dict] = None
               ) -> Dict[fx.Node, Decision]:
        return {node: self.decision(node, args, kwargs or {})}

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        """The node's decision (its op label included)."""
        raise NotImplementedError
