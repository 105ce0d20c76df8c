"""Healing: after ``heal_after`` forward overflows in a low-precision node, the trainer
rewrites the original model with that node in FP32 (the first rewrite's
:class:`~fxamp.config.RewriteConfig` plus ``fp32:NODE``) and swaps the new GraphModule in.

:class:`HealingMixin` holds these methods of :class:`fxamp.train.Trainer`; they read the
trainer's ``heal_backward``, ``heal_after``, ``original_model``, ``example_inputs`` and
``_config`` and update ``node_overflows``, ``healed``, ``gm`` and ``module``.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Dict

import torch
import torch.nn as nn

from ..config import FRONTENDS, RewriteConfig
from ..ir import Rule
from ..result import has_result, result_of, set_result
from ..policy import Policy
from ..rewriter import amp_rewrite, plan_of
from .localize import Overflow

log = logging.getLogger("fxamp.train.trainer")  # the trainer's logger, as before the split


def healing_config(gm: nn.Module, policy: str) -> RewriteConfig:
    """The RewriteConfig ``gm`` was made with; for a module without one (a nested part of
    a rewrite, say) the plan's policy with the front end its header names."""
    config = result_of(gm).config if has_result(gm) else None
    if config is not None:
        return config
    frontend = plan_of(gm).header.get("frontend", "auto")
    # the header names the front end that took it (fx+runtime, eager: only under auto)
    return RewriteConfig(Policy.parse(policy), frontend if frontend in FRONTENDS else "auto")


class HealingMixin:
    """The trainer's healing methods."""

    def _maybe_heal(self, overflow: Overflow) -> str:
        counted = overflow.phase == "forward" or (self.heal_backward
                                                  and overflow.phase == "backward")
        low = overflow.dtype in (torch.float16, torch.bfloat16)
        if not (counted and low and overflow.node) or overflow.node in self.healed:
            return ""
        self.node_overflows[overflow.node] += 1
        if self.node_overflows[overflow.node] < self.heal_after:
            return ""
        reason = (f"healed at step {overflow.step}: {overflow.phase} overflow in "
                  f"{self.node_overflows[overflow.node]} skipped steps")
        self._rewrite_with({**self.healed, overflow.node: reason})
        log.warning("fxamp.train: moved node %r to fp32 (%s)", overflow.node, reason)
        return overflow.node

    def _rewrite_with(self, healed: Dict[str, str]) -> None:
        """Rewrite the original model with ``healed`` nodes in FP32 and swap it in."""
        if not healed:
            return
        config = self._config.with_fp32(healed)
        gm = amp_rewrite(self.original_model, self.example_inputs, config=config)
        plan = plan_of(gm)
        nodes = {name: replace(p, rule=Rule.HEAL, reason=healed[name]) if name in healed
                 else p for name, p in plan.nodes.items()}
        set_result(gm, result_of(gm).replace(plan=replace(plan, nodes=nodes)))
        gm.train(self.gm.training)
        self.gm = self.module = gm
        self.healed = dict(healed)
