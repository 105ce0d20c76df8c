"""The graphs that make up one rewritten graph module.

A front end may move part of a rewritten graph into a submodule's own graph (a checkpoint
region runs its nodes inside ``torch.utils.checkpoint``: ``frontends/checkpoint_regions``);
such a graph is marked with :data:`PART` and its nodes keep their plan names. Code reading
every node of a rewrite (the audit) walks :func:`graph_parts` instead of ``gm.graph``.
"""
from __future__ import annotations

from typing import Iterator

import torch.fx as fx
import torch.nn as nn

#: attribute set (True) on a GraphModule whose nodes are part of the enclosing rewrite's graph
PART = "fxamp_graph_part"


def graph_parts(gm: nn.Module) -> Iterator[fx.GraphModule]:
    """``gm`` (when it is a GraphModule) and every GraphModule inside it marked
    :data:`PART`, in module order."""
    if isinstance(gm, fx.GraphModule):
        yield gm
    for _, module in gm.named_modules(remove_duplicate=True):
        if module is not gm and isinstance(module, fx.GraphModule) and \
                getattr(module, PART, False):
            yield module
