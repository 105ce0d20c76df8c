"""The deployment plan's annotate rule (rule "deploy"): all low precision unless a number or
the engine needs FP32.

For a deployment target (``target="tensorrt"``) :class:`DeployRule` takes the place of
autocast's op tables. Autocast's FP32 lists are right for training (FP32 gradients of
softmax, norms, losses); an inference engine runs those ops in FP16 well, and the ONNX tools
start all-FP16 too. So every floating op computes in the low dtype, except:

* an op the engine has no FP16 kernel for (``ops.engine_fp32_op``, read from its
  published operator table);
* a deep reduction: more than :data:`DEEP_REDUCTION` values summed per output (an FP16
  accumulator loses the small terms);
* an op torch.autocast refuses as unsafe in the low dtype (``binary_cross_entropy``);
* the model's own conversions (``x.float()``) and ops given a dtype do what they say.

Shape-only ops (view, permute, getitem ...) follow their inputs, so casts stay where the
values are computed. The other reasons for FP32 are the later passes': value ranges on the
example inputs and calibration data (``passes/ranges.py``), norms whose eps the low dtype
loses (``passes/norm_eps.py``), hand-written softmax (``passes/softmax.py``), losses.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
from .._torch import tree_flatten

from .. import ops
from ..ir import Decision, Rule
from ..policy import dtype_name
from .annotate_rule import AnnotateRule
from .mask_fill import fill_reason  # rule "mask_fill"

#: a reduction of more values than this per output runs in FP32 in a deployment plan
DEEP_REDUCTION = 4096

_CALLS = ops.OP_NODES


def _floats(node: fx.Node, gm: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    leaves, _ = tree_flatten((args, kwargs))
    values = [v for v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if node.op == "call_module":
        values += [p for p in gm.get_submodule(node.target).parameters()
                   if p.is_floating_point()]
    return values


def reduction_depth(args: tuple) -> Optional[int]:
    """Values reduced per output of a reduction called with ``args`` (its input tensor and
    dims), or None when it cannot be told."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    dims = args[1] if len(args) > 1 else None
    if dims is None or isinstance(dims, torch.dtype):
        return int(x.numel())
    dims = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) \
        else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    if not dims:
        return int(x.numel())
    return int(math.prod(int(x.shape[d]) for d in dims)) if x.dim() else 1


class RecurrentRule(AnnotateRule):
    """A deployment plan's LSTM / GRU / RNN module: the low dtype, weights and all (ONNX
    LSTM, GRU and RNN run in FP16 in the engines, as the ONNX tools write them), where a
    training plan leaves the call to torch.autocast at run time."""

    name = Rule.DEPLOY

    def applies(self, node: fx.Node) -> bool:
        return node.op == "call_module" and isinstance(
            self.gm.get_submodule(str(node.target)), torch.nn.RNNBase)

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        low, label = self.policy.compute, self.label(node)
        return Decision(low, self.name, f"deployment plan for {self.policy.target}: a "
                        f"recurrent layer in {dtype_name(low)} (ONNX {label[3:]}, weights "
                        f"and state in {dtype_name(low)})", label)


class DeployRule(AnnotateRule):
    """A deployment target's rule: the low dtype unless the engine or the op needs FP32."""

    name = Rule.DEPLOY

    def applies(self, node: fx.Node) -> bool:
        return True

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        target, low = self.policy.target, self.policy.compute
        label = self.label(node)
        if node.op not in _CALLS:
            return Decision(None, self.name, "follows its inputs", label)
        category, op, _ = ops.autocast_entry(node, self.gm, target)
        _, names = ops.autocast_ops(node, self.gm)
        names = tuple(names or ())
        fill = fill_reason(node)
        if fill is not None:
            return Decision(low, Rule.MASK_FILL, fill, label)
        if not _floats(node, self.gm, args, kwargs):
            return Decision(None, self.name, "no floating input: follows its inputs", label)
        if category == ops.BANNED:
            return Decision(torch.float32, self.name, f"{op} is unsafe in {dtype_name(low)} "
                            "(torch.autocast refuses it): fp32", label)
        explicit = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype)
                                                          for a in args[1:])
        if ops.is_conversion(node):
            return Decision(None, self.name, "the model's own dtype conversion", label)
        if explicit:
            return Decision(None, self.name, f"{label} runs in the dtype it is given", label)
        for name in names:
            onnx_op = ops.engine_fp32_op(name, target)
            if onnx_op is not None:
                return Decision(torch.float32, self.name, f"{name} exports to ONNX {onnx_op}, "
                                f"which {target} has no {dtype_name(low)} kernel for (its "
                                "operator table): fp32", label)
        if any(ops.is_reduction(name) for name in names):
            depth = reduction_depth(args)
            if depth is not None and depth > DEEP_REDUCTION:
                return Decision(torch.float32, self.name, f"reduces {depth} values per output "
                                f"(more than {DEEP_REDUCTION}: a {dtype_name(low)} "
                                "accumulator loses the small terms): fp32", label)
        if not names and ops.moves_values(node):
            return Decision(None, self.name, "moves values, computes nothing: follows its "
                            "inputs", label)
        if not names and node.op == "call_module":  # BatchNorm, Dropout, Identity ...
            return Decision(None, self.name, "computes in its input's dtype (its parameters "
                            "and statistics stay fp32; a BatchNorm folds into its conv on "
                            "export)", label)
        return Decision(low, self.name, f"deployment plan for {target}: "
                        f"{dtype_name(low)} (no number here needs fp32)", label)

