"""``fxamp.audit``: rewrite the model as asked, then read the result with the check passes
(``fxamp.passes.audit.audit_graph`` and friends, which know nothing of the rewriter).

The rewrite runs with one ``RewriteConfig`` (front end and example
kwargs included), so the audited decisions are exactly the rewrite's. When the rewrite
refuses the model for a banned op it is rewritten again with an ``fp32:<node>`` override per
banned node, so those are reported rather than raised. A model in block mode (rewritten in
place without example inputs, ``rewriter/blocks.py``) is audited as its FP32 form, a shadow
with its own forwards back (``overlap.own_forwards``): the model keeps its block mode.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from .. import ops
from ..config import RewriteConfig, model_target
from ..errors import FxampError
from ..frontends import trace_model
from ..passes.audit.findings import Finding
from ..passes.audit.context import audit_context
from ..passes.audit.results import audit_result
from ..policy import Policy, make_policy
from .blocks import is_blocks
from .overlap import own_forwards
from .pipeline import amp_rewrite

log = logging.getLogger(__name__)


def _banned_nodes(model: nn.Module, args: tuple, config: RewriteConfig) -> List[str]:
    """Names of the model's graph nodes (as the config's front end traces it) on autocast's
    banned list for the policy's target."""
    try:
        src = trace_model(model, args, dict(config.example_kwargs or {}),
                          config.frontend).graph_module
    except FxampError:
        return []
    names = []
    for node in src.graph.nodes:
        if node.op not in ops.OP_NODES:
            continue
        if ops.category(node, src, config.policy.target) == ops.BANNED:
            names.append(node.name)
    return names


def audit(model: nn.Module, example_inputs: Union[None, Sequence[Any], Any] = None, *,
          example_kwargs: Optional[Dict[str, Any]] = None,
          dtype: torch.dtype = torch.float16, target: Optional[str] = None,
          policy: Union[None, str, Policy] = None, frontend: str = "auto",
          optimizer: Optional[torch.optim.Optimizer] = None, scaler: Any = None,
          batch: Any = None, steps_per_epoch: Optional[int] = None,
          onnx: Optional[str] = None, config: Optional[RewriteConfig] = None
          ) -> List[Finding]:
    """Audit ``model`` for mixed precision: a list of ``Finding``, changing nothing.

    The model is rewritten with ``fxamp.amp_rewrite`` as asked (same ``frontend`` and
    ``example_kwargs``; the rewrite shares the model's Parameters and leaves the model as it
    was) and every rewritten graph is read: the top graph, graphs nested in it, and for the
    eager front end each rewritten child; the parts that run under torch.autocast at run time
    are listed (``runs-under-autocast``) and their norm modules checked. A model the rewrite
    refuses for a banned op is rewritten again with an ``fp32:<node>`` override per banned
    node, so those are reported rather than raised. The optional training and deployment
    context is read by ``passes/audit/context.py``.

    Args:
        model: the FP32 model to audit (left unchanged; a model in block mode keeps it).
        example_inputs: the forward's positional arguments (a tuple, or one tensor).
        example_kwargs: the forward's keyword arguments.
        dtype: the low-precision dtype.
        target: ``"cuda"``, ``"cpu"`` or ``"tensorrt"``, as in ``amp_rewrite`` (by default
            the device the model is on).
        policy: a ``Policy`` or its text form.
        frontend: the front end, as in ``amp_rewrite``.
        optimizer: the training optimizer: its param dtypes and eps are checked.
        scaler: a ``torch.amp.GradScaler``: whether it is enabled, its device, its
            ``growth_interval`` against ``steps_per_epoch``.
        batch: one data batch: its input dtypes and ranges are checked.
        steps_per_epoch: optimizer steps per epoch, for the scaler's growth interval.
        onnx: the path of an exported ONNX file: its opset and dynamic axes are checked.
        config: a ``RewriteConfig`` (e.g. ``fxamp.config_of(gm)``) given instead of
            ``dtype``, ``target``, ``policy``, ``frontend`` and ``example_kwargs``.

    Returns:
        The findings, those of the graphs first, then those of the context.

    Raises:
        FxampError: the model cannot be rewritten for another reason than a banned op
            (the subclass names the cause, as ``amp_rewrite`` does).
    """
    if config is None:
        target = target or model_target(model, (example_inputs, example_kwargs))
        config = RewriteConfig(make_policy(policy, dtype, target), frontend,
                               dict(example_kwargs) if example_kwargs else None)
    pol = config.policy
    args = () if example_inputs is None else (
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else
        (example_inputs,))
    # (block mode: a flat rewrite of the model would take its blocks' rewrites off; the
    # shadow's are taken off instead, and the model computes with its own as before)
    view = own_forwards(model) if isinstance(model, nn.Module) and is_blocks(model) else None
    try:
        gm = _rewrite(model if view is None else view.root, args, config)
    finally:
        if view is not None:
            view.release()
    findings = audit_result(gm, pol)
    findings += audit_context(model, pol, optimizer=optimizer, scaler=scaler, batch=batch,
                              steps_per_epoch=steps_per_epoch, onnx=onnx)
    return findings


def _rewrite(model: nn.Module, args: tuple, config: RewriteConfig) -> nn.Module:
    """``amp_rewrite(model, args, config)``; a model it refuses for a banned op is rewritten
    with an ``fp32:<node>`` override per banned node.

    Args:
        model: the model to rewrite (a block-mode model's FP32 shadow).
        args: the example's positional arguments.
        config: the rewrite's config.
    """
    try:
        return amp_rewrite(model, args, config=config)
    except FxampError as err:
        banned = _banned_nodes(model, args, config) if isinstance(model, nn.Module) else []
        if not banned:
            raise
        log.info("audit: the rewrite refused %s (%s); auditing with FP32 overrides for them",
                 ", ".join(banned), str(err).splitlines()[0])
        return amp_rewrite(model, args, config=config.with_fp32(banned))
