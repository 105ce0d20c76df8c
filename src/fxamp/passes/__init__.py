"""Precision passes. Annotate passes write ``node.meta["fxamp"]`` only; rewrite passes read it.

A pass is a callable returning :class:`PassResult` (after torch.fx's passes infra).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) graph module and whether it changed anything."""

    graph_module: fx.GraphModule
    modified: bool
