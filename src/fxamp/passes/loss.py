"""Loss pass (rule "loss"): losses inside the traced model take FP32 inputs.

Every torch loss (module or function) gets FP32 inputs even where autocast's list for the
target leaves it in the low dtype (and ``binary_cross_entropy``, which CUDA autocast refuses,
runs in FP32). A hand-written loss — a reduction to a scalar of squared, absolute or log terms
(``((pred - y) ** 2).mean()``, ``(a - b).abs().sum()``, ``-torch.log(p).mean()``) — has the
op that would underflow and the reduction after it upcast: an MSE of residuals near 1e-4 is 0
in fp16 (1e-8 is below its smallest subnormal). When the model returns logits and the loss is
computed outside, ``Policy(output_dtype=...)`` decides the output dtype (FP32 by default).
"""
from __future__ import annotations

import operator
from typing import Dict, List

import torch
import torch.fx as fx

from .. import oplists
from ..oplists import call_name
from .. import ir
from ..ir import Decision, Rule
from .rule import DecisionRule, rule_pass

LOSS_MODULES = tuple(cls for cls in oplists.MODULE_OPS if cls.__name__.endswith("Loss"))
LOSS_FUNCTIONS = {fn for fn, ops in oplists.FUNCTION_OPS.items()
                  if getattr(fn, "__name__", "").endswith(("_loss", "cross_entropy", "kl_div"))}
# torch.export graphs name the ATen loss ops themselves
LOSS_FUNCTIONS |= {overload for name in ("cross_entropy_loss", "mse_loss", "l1_loss",
                                         "smooth_l1_loss", "huber_loss", "kl_div", "nll_loss",
                                         "nll_loss2d", "binary_cross_entropy_with_logits",
                                         "poisson_nll_loss", "soft_margin_loss",
                                         "margin_ranking_loss", "hinge_embedding_loss",
                                         "multilabel_margin_loss", "multi_margin_loss")
                   for overload in [getattr(torch.ops.aten, name).default]}
_REDUCE = {"mean", "sum"}
_TERMS = {"pow", "square", "abs", "log", "log1p", "__pow__", "log2", "log10"}
_PASS_THROUGH = {"mul", "neg", "__mul__", "__neg__", "truediv", "__truediv__", "div"}


def _is_loss_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), LOSS_MODULES)
    return node.op == "call_function" and node.target in LOSS_FUNCTIONS


def _hand_written_chain(node: fx.Node) -> List[fx.Node]:
    """[reduction, ..., term op] when ``node`` reduces squared/abs/log terms to a scalar."""
    if node.op not in ("call_function", "call_method") or call_name(node) not in _REDUCE:
        return []
    shape = ir.get(node).shape
    if shape is None or len(shape) != 0:
        return []
    chain = [node]
    current = node.args[0] if node.args else None
    for _ in range(4):
        if not isinstance(current, fx.Node):
            return []
        name = call_name(current)
        if name in _TERMS or (current.target in (operator.mul, torch.ops.aten.mul.Tensor) and len(current.args) == 2
                              and current.args[0] is current.args[1]):
            return chain + [current]
        if name not in _PASS_THROUGH:
            return []
        chain.append(current)
        current = current.args[0] if current.args else None
    return []


class LossRule(DecisionRule):
    """Losses in FP32: loss modules and functions get fp32 inputs; a hand-written loss
    (squared / abs / log terms reduced to a scalar) runs in fp32 from its terms on."""

    name = Rule.LOSS

    def applies(self, node: fx.Node) -> bool:
        return ir.precision(node) is not None

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        plan = ir.precision(node)
        if _is_loss_call(self.gm, node):
            if plan.inputs != torch.float32 or plan.rule == Rule.BANNED:
                return {node: self.verdict(torch.float32,
                                           f"{plan.op} is a loss: its inputs are cast to fp32")}
            return {}
        chain = _hand_written_chain(node)
        if chain and any(ir.precision(m) is None or ir.precision(m).dtype != torch.float32
                         for m in chain):
            d = self.verdict(torch.float32, f"hand-written loss: {call_name(chain[-1])} terms "
                             "reduced to a scalar run in fp32 (small terms underflow in the "
                             "low dtype)")
            return {member: d for member in chain}
        return {}


#: the loss pass: ``(gm, ctx) -> PassResult``
loss_in_fp32 = rule_pass(LossRule)
