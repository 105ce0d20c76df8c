"""Precision passes. Annotate and the decision rules write the IR (``fxamp.ir``); rewrite
passes read it.

A pass is a callable returning :class:`PassResult` (after torch.fx's passes infra).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) graph module and whether it changed anything."""

    graph_module: fx.GraphModule
    modified: bool


def fetch_attr(root: Any, target: str) -> Any:
    """The attribute a get_attr target ("layer1.0.conv1.weight") names, or None."""
    value = root
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
