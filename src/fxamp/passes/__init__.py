"""Precision passes. Annotate and the decision rules write the IR (``fxamp.ir``); rewrite
passes read it.

A pass is a callable returning :class:`PassResult` (after torch.fx's passes infra).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..ops import fetch_attr  # noqa: F401 - the passes import it from here


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) graph module and whether it changed anything."""

    graph_module: fx.GraphModule
    modified: bool
