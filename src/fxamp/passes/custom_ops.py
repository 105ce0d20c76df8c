"""Custom ops pass (rule "custom_ops"): calls fxamp cannot see into and autocast has no rule
for get FP32 inputs and run without autocast — what ``custom_fwd(cast_inputs=torch.float32)``
does by hand — unless the policy names them low precision.

Fenced: custom ``torch.autograd.Function``s, functions kept whole by ``torch.fx.wrap`` outside
torch and torchvision's known ones, and ``torch.library`` custom ops without an autocast
kernel. Their outputs flow on in FP32 (as with ``custom_fwd``); the next listed op casts them.
Left to autocast at run time (rule "runtime"): composite ``torch.nn`` modules (autocast handles
the ops inside), custom ops that register an autocast kernel, and torchvision's wrapped
functions listed in ``KNOWN_RUNTIME``.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.fx as fx

from .. import ops
from .._torch import OpOverload, OpOverloadPacket, has_kernel_for_dispatch_key
from ..ir import Decision, Rule
from .rule import DecisionRule, rule_pass

#: fx.wrap'ed library functions whose insides autocast handles correctly at run time
KNOWN_RUNTIME = {
    "torchvision.ops.stochastic_depth.stochastic_depth",
    "torchvision.models.swin_transformer.shifted_window_attention",
    "torchvision.models.swin_transformer._patch_merging_pad",
    "torchvision.models.swin_transformer._get_relative_position_bias",
    "torchvision.models.video.swin_transformer.shifted_window_attention_3d",
    "torchvision.models.video.swin_transformer._get_relative_position_bias",
}


def _has_autocast_kernel(op: object) -> bool:
    name = getattr(op, "_qualified_op_name", None) or getattr(op, "name", lambda: "")()
    overloads = getattr(op, "overloads", lambda: [])()
    names = [f"{name}.{o}" if o != "default" else name for o in overloads] or [name]
    return any(has_kernel_for_dispatch_key(n, key)
               for n in names for key in ("AutocastCPU", "AutocastCUDA"))


def is_custom(node: fx.Node) -> bool:
    """An opaque call autocast has no rule for (see the module docstring)."""
    if node.op != "call_function":
        return False
    fn = node.target
    if getattr(fn, "fxamp_function", None) is not None:  # a custom autograd.Function
        return True
    if isinstance(fn, (OpOverloadPacket, OpOverload)):
        return not _has_autocast_kernel(fn)
    qualname = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
    return qualname not in KNOWN_RUNTIME


class CustomOpsRule(DecisionRule):
    """Give opaque custom calls FP32 inputs. Runs before annotation (it needs no dtypes, and
    such a call may refuse low-precision inputs even in the fake run)."""

    name = Rule.CUSTOM_OPS

    def applies(self, node: fx.Node) -> bool:
        return (node.op == "call_function" and ops.is_runtime(node, self.gm)
                and is_custom(node))

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        return {node: self.verdict(
            torch.float32, f"{ops.label(node, self.gm)} has no autocast rule: its floating "
            "inputs are cast to fp32 and it runs without autocast, as "
            "custom_fwd(cast_inputs=float32) does")}


#: the custom-ops pass: ``(gm, ctx) -> PassResult``
fence_custom_ops = rule_pass(CustomOpsRule)
