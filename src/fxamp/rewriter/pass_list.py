"""The pass list of a rewrite (``pass_list``), its annotate step (``annotate_pass``) and its
override check (``check_overrides``): ordinary passes reading what they need from the
pass context.

Each pass is ``(gm, ctx) -> PassResult`` (``passes/manager.py``); ``amp_rewrite`` runs this
list with a ``PassManager``. docs/architecture.md ("The pass list") describes each step.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.fx as fx

from .. import ir
from ..errors import FxampError
from ..overrides import check_matched
from ..plan import Plan
from ..passes import (PassResult, custom_ops, joins, layout, loss, mask_fill, norm_eps,
                      softmax)
from ..passes.annotate import FakeSession, annotate, check_banned
from ..passes.casts import insert_casts
from ..passes.manager import PassContext, Step, fixpoint
from ..passes.placement import place_casts
from ..passes.ranges import keep_in_range
from ..passes.rule import user_rules
from ..frontends.aten import quiet_torch_logs
from ..frontends.common import nested_lines


def pass_list() -> List[Step]:
    """The passes of a rewrite, in order (each ``(gm, ctx) -> PassResult``; see
    ``passes/manager.py``). The decision steps re-run the annotate step after each change,
    and are swept to a fixpoint."""
    def numerics(rule: str) -> Callable[[PassContext], bool]:
        return lambda ctx: ctx.policy.runs(rule)

    return [
        # graph rewrites before any dtype is known
        Step("softmax", softmax.stable_softmax, numerics("softmax"), rewrites=True),
        Step("custom_ops", custom_ops.fence_custom_ops, numerics("custom_ops")),
        # a deployment plan's attention-mask fills: FP16's lowest, so masks stay FP16
        Step("mask_fill", mask_fill.mask_fills, mask_fill.runs, rewrites=True),
        # the one fake run: every node's dtype under autocast (and the decisions so far)
        Step("annotate", annotate_pass, annotates=True),
        # every node is decided: an override that matches nothing fails before the costly
        # passes
        Step("overrides", check_overrides, lambda ctx: bool(ctx.policy.overrides)),
        fixpoint("decide", [
            Step("norm_eps", norm_eps.norm_eps, numerics("norm_eps"), decides=True),
            Step("loss", loss.loss_in_fp32, numerics("loss"), decides=True),
            Step("joins", joins.consistent_joins, numerics("joins"), decides=True),
            Step("ranges", keep_in_range, decides=True),
            # the user's rules (amp_rewrite(..., rules=[...])) decide last: fxamp's own
            # rules leave the nodes they decide alone
            Step("user_rules", user_rules, lambda ctx: bool(ctx.rules), decides=True),
        ]),
        Step("placement", place_casts, lambda ctx: ctx.policy.placement, decides=True),
        Step("banned", check_banned),
        Step("layout", layout.channels_last, lambda ctx: ctx.policy.channels_last),
        Step("casts", insert_casts),
    ]


def annotate_pass(src: fx.GraphModule, ctx: PassContext) -> PassResult:
    """annotate's fake run (one FakeSession per rewrite: later runs re-execute only the
    nodes whose decision or inputs changed), with torch's fake-tensor logging kept from the
    user and the model's attributes restored after it (hooks run on fake tensors there)."""
    grad = torch.is_grad_enabled()
    try:
        with quiet_torch_logs():
            if ctx.session is None or ctx.session.gm is not src:
                ctx.session = FakeSession(src, ctx.inputs)
            return annotate(src, ctx.inputs, ctx.policy, ctx.session, ctx.scope)
    except FxampError as err:  # fx's notes ("While executing ..., Use tlparse") are noise
        if hasattr(err, "__notes__"):
            del err.__notes__
        raise
    finally:
        torch.set_grad_enabled(grad)
        if ctx.state is not None:
            ctx.state.restore()


def plan_lines(nodes: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    """(node name, module path, op) of each plan line: what overrides are matched against."""
    return [(name, p.module, p.op) for name, p in nodes.items()]


def plan_nodes(src: fx.GraphModule, nested: Dict[str, Plan]) -> Dict[str, Any]:
    """The plan lines of ``src``'s decided nodes, then each nested plan's under ``path/``."""
    nodes = {n.name: ir.precision(n) for n in src.graph.nodes if ir.precision(n)}
    nodes.update(nested_lines(nested))
    return nodes


def check_overrides(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """A check of the top-level rewrite: PolicyError for an override that matches no node
    (nested rewrites' matches are in its scope)."""
    if ctx.scope is not None and ctx.scope.top:
        check_matched(ctx.policy, ctx.scope, plan_lines(plan_nodes(gm, ctx.nested)))
    return PassResult(gm, modified=False)
