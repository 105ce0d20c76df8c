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

from .. import ir, ops
from ..ir import Decision, Rule
from .rule import DecisionRule, rule_pass

_REDUCE = {"mean", "sum"}
#: op names (``ops.name``: fx functions, tensor methods and their dunders, ATen ops alike)
_TERMS = {"pow", "square", "abs", "log", "log1p", "log2", "log10"}
_PASS_THROUGH = {"mul", "neg", "truediv", "div"}
_MULS = (operator.mul, torch.ops.aten.mul.Tensor)


def _hand_written_chain(node: fx.Node) -> List[fx.Node]:
    """[reduction, ..., term op] when ``node`` reduces squared/abs/log terms to a scalar."""
    if node.op not in ("call_function", "call_method") or ops.name(node) not in _REDUCE:
        return []
    shape = ir.get(node).shape
    if shape is None or len(shape) != 0:
        return []
    chain = [node]
    current = node.args[0] if node.args else None
    for _ in range(4):
        if not isinstance(current, fx.Node):
            return []
        name = ops.name(current)
        if name in _TERMS or (ops.is_call(current, _MULS) and len(current.args) == 2
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
        if ops.is_loss(node, self.gm):
            if plan.inputs != torch.float32 or plan.rule == Rule.BANNED:
                return {node: self.verdict(torch.float32,
                                           f"{plan.op} is a loss: its inputs are cast to fp32")}
            return {}
        chain = _hand_written_chain(node)
        if chain and any(ir.precision(m) is None or ir.precision(m).dtype != torch.float32
                         for m in chain):
            d = self.verdict(torch.float32, f"hand-written loss: {ops.name(chain[-1])} terms "
                             "reduced to a scalar run in fp32 (small terms underflow in the "
                             "low dtype)")
            return {member: d for member in chain}
        return {}


#: the loss pass: ``(gm, ctx) -> PassResult``
loss_in_fp32 = rule_pass(LossRule)
