"""``fxamp.audit``: rewrite the model as asked, then read the result with
:func:`fxamp.passes.audit.audit_graph` (the check pass, which knows nothing of the rewriter).

The rewrite runs with one :class:`~fxamp.config.RewriteConfig` (front end included), so the
audited decisions are exactly the rewrite's. When the rewrite refuses the model for a banned
op it is rewritten again with an ``fp32:<node>`` override per banned node, so those are
reported rather than raised.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from .. import oplists
from ..config import RewriteConfig
from ..errors import FxampError
from ..frontends import trace_model
from ..passes.audit import Finding, audit_graph
from ..policy import Policy, make_policy
from .pipeline import _as_tuple, amp_rewrite, plan_of

log = logging.getLogger(__name__)


def _banned_nodes(model: nn.Module, args: tuple, config: RewriteConfig) -> List[str]:
    """Names of the traced model's nodes on autocast's banned list for the policy's target,
    traced with the config's front end (the rewrite's node names)."""
    src = trace_model(model, args, dict(config.example_kwargs or {}),
                      config.frontend).graph_module
    names = []
    for node in src.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        _, ops = oplists.node_ops(node, src)
        if ops and oplists.category_of(ops, config.policy.target)[0] == oplists.BANNED:
            names.append(node.name)
    return names


def audit(model: nn.Module, example_inputs: Union[Sequence[Any], Any], *,
          dtype: torch.dtype = torch.float16, target: str = "cuda",
          policy: Union[None, str, Policy] = None, frontend: str = "auto",
          config: Optional[RewriteConfig] = None) -> List[Finding]:
    """Audit ``model`` for mixed precision: a list of :class:`Finding`, changing nothing.

    The model is rewritten with :func:`fxamp.amp_rewrite` as asked (the rewrite shares the
    model's Parameters and leaves the model as it was) and the rewritten graph is read. A model
    the rewrite refuses for a banned op is rewritten again with an ``fp32:<node>`` override per
    banned node, so those are reported rather than raised. ``config`` (a RewriteConfig)
    replaces dtype, target, policy and frontend.
    """
    if config is None:
        config = RewriteConfig(make_policy(policy, dtype, target), frontend)
    try:
        gm = amp_rewrite(model, example_inputs, config=config)
    except FxampError as err:
        banned = (_banned_nodes(model, _as_tuple(example_inputs), config)
                  if isinstance(model, nn.Module) else [])
        if not banned:
            raise
        log.info("audit: the rewrite refused %s (%s); auditing with FP32 overrides for them",
                 ", ".join(banned), str(err).splitlines()[0])
        gm = amp_rewrite(model, example_inputs, config=config.with_fp32(banned))
    return audit_graph(gm, plan_of(gm), config.policy)
