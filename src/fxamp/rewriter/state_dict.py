"""The rewritten module's ``state_dict()`` has the model's keys, also for unused parts.

A ``torch.fx.GraphModule`` holds only the attributes its graph reads: a submodule or
Parameter that this forward does not use (GoogLeNet's auxiliary heads in eval mode, a head
used only by another method) is missing, so ``gm.load_state_dict(checkpoint)`` fails. The
missing modules, Parameters and buffers are attached to the rewritten module at their paths
(the same objects; a non-persistent buffer stays non-persistent).
"""
from __future__ import annotations

import logging
from typing import List

import torch.nn as nn

log = logging.getLogger(__name__)


def _child(module: nn.Module, name: str) -> nn.Module | None:
    return module._modules.get(name)


def complete_state(model: nn.Module, gm: nn.Module) -> List[str]:
    """Attach to ``gm`` what ``model`` has and ``gm`` lacks; return the attached paths."""
    attached: List[str] = []
    for path, module in model.named_modules():
        if not path:
            target: nn.Module | None = gm
        else:
            parent_path, _, name = path.rpartition(".")
            parent = gm.get_submodule(parent_path) if parent_path else gm
            target = _child(parent, name)
            if target is None:
                parent.add_module(name, module)  # the whole subtree, shared
                attached.append(path)
                continue
        if target is module:
            continue
        prefix = f"{path}." if path else ""
        for name, param in module._parameters.items():
            if name not in target._parameters and not hasattr(target, name):
                target.register_parameter(name, param)
                attached.append(prefix + name)
        for name, buf in module._buffers.items():
            if name not in target._buffers and not hasattr(target, name):
                target.register_buffer(name, buf,
                                       persistent=name not in module._non_persistent_buffers_set)
                attached.append(prefix + name)
    if attached:
        log.debug("attached unused parts of %s: %s", type(model).__name__, ", ".join(attached))
    return attached
