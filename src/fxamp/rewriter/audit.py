"""``fxamp.audit``: rewrite the model as asked, then read the result with the check passes
(``fxamp.passes.audit.audit_graph`` and friends, which know nothing of the rewriter).

The rewrite runs with one ``RewriteConfig`` (front end and example kwargs included), given
as ``amp_rewrite``'s ``config`` is (the old keywords are deprecated: ``search.tool_config``),
so the audited decisions are exactly the rewrite's. When the rewrite
refuses the model for a banned op it is rewritten again with an ``fp32:<node>`` override per
banned node, so those are reported rather than raised. A model in block mode (rewritten in
place without example inputs, ``rewriter/blocks.py``) is audited as its FP32 form, a shadow
with its own forwards back (``overlap.own_forwards``): the model keeps its block mode.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from .. import ops
from ..config import RewriteConfig
from ..errors import FxampError
from ..frontends import trace_model
from ..passes.audit.findings import Finding
from ..passes.audit.context import audit_context
from ..passes.audit.results import audit_result
from ..policy import Policy
from .overlap import fp32_form
from .pipeline import amp_rewrite
from .search import tool_config

#: the keywords ``audit`` took before ``config`` held them
AUDIT_KEYWORDS = ("example_kwargs", "dtype", "target", "policy", "frontend")

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


def audit(model: nn.Module, example_inputs: Union[None, Sequence[Any], Any] = None,
          config: Union[None, str, Policy, RewriteConfig] = None, *,
          optimizer: Optional[torch.optim.Optimizer] = None, scaler: Any = None,
          batch: Any = None, steps_per_epoch: Optional[int] = None,
          onnx: Optional[str] = None, **deprecated: Any) -> List[Finding]:
    """Audit ``model`` for mixed precision: a list of ``Finding``, changing nothing.

    The model is rewritten with ``fxamp.amp_rewrite`` as asked (the same ``config``: its
    front end and example kwargs too; the rewrite shares the model's Parameters and leaves
    the model as it was) and every rewritten graph is read: the top graph, graphs nested in
    it, and for the eager front end each rewritten child; the parts that run under
    torch.autocast at run time are listed (``runs-under-autocast``) and their norm modules
    checked. A model the rewrite refuses for a banned op is rewritten again with an
    ``fp32:<node>`` override per banned node, so those are reported rather than raised. The
    optional training and deployment context is read by ``passes/audit/context.py``.

    Args:
        model: the FP32 model to audit (left unchanged; a model in block mode keeps it).
        example_inputs: the forward's positional arguments (a tuple, or one tensor).
        config: the rewrite to audit, as ``amp_rewrite``'s ``config``: a ``RewriteConfig``
            (``RewriteConfig.make(dtype=..., target=..., policy=..., frontend=...,
            example_kwargs=...)``, or ``fxamp.config_of(gm)`` of an earlier rewrite), a
            ``Policy``, or a policy's text form (``"compute=bf16,target=cpu"``, a recipe
            name); None: ``RewriteConfig.make()``, float16 for the device the model is on.
        optimizer: the training optimizer: its param dtypes and eps are checked.
        scaler: a ``torch.amp.GradScaler``: whether it is enabled, its device, its
            ``growth_interval`` against ``steps_per_epoch``.
        batch: one data batch: its input dtypes and ranges are checked.
        steps_per_epoch: optimizer steps per epoch, for the scaler's growth interval.
        onnx: the path of an exported ONNX file: its opset and dynamic axes are checked.
        **deprecated: the keywords the config holds that ``audit`` took before
            (``example_kwargs``, ``dtype``, ``target``, ``policy``, ``frontend``), taken
            for one more release with a ``FutureWarning``: they build
            ``RewriteConfig.make(**deprecated)``.

    Returns:
        The findings, those of the graphs first, then those of the context.

    Raises:
        FxampError: the model cannot be rewritten for another reason than a banned op
            (the subclass names the cause, as ``amp_rewrite`` does), or ``config``
            together with the (deprecated) keywords it holds.
        TypeError: a keyword ``audit`` does not take.
    """
    config = tool_config("audit", "model, example_inputs", config, deprecated,
                         AUDIT_KEYWORDS)
    config = config.for_model(model, (example_inputs, config.example_kwargs))
    pol = config.policy
    args = () if example_inputs is None else (
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else
        (example_inputs,))
    # (a model rewritten in place: its FP32 form is rewritten, and the model keeps its own
    # rewrite, its block mode included)
    with fp32_form(model) as fp32:
        gm = _rewrite(fp32, args, config)
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
