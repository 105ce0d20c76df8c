"""Attention-mask fills in a deployment plan: ``finfo(float32).min`` written as FP16's lowest.

Models build an additive attention mask from a huge negative constant: GPT-2's causal mask
and DistilBERT's padding mask are ``where(mask, 0, finfo(float32).min)``, T5's is
``(1 - mask) * finfo(float32).min``; older code writes ``-1e9``, ``-1e4`` or ``-inf``. In
FP16 such a fill is -inf (or past the deployment plan's range limit), so the ranges rule kept
the mask, the scores it is added to and the softmax in FP32: two Casts per attention block
in the ONNX file. After the softmax the fill only has to make ``exp`` give 0, which FP16's
lowest finite value, -65504, does as well (onnxconverter-common writes the same), and it
keeps a fully padded row finite: every score of it is near -65504, the softmax is uniform,
as in FP32.

This graph pass (rule "mask_fill"; ``off:mask_fill`` in the policy switches it off) runs
before annotation, for a deployment plan in FP16 only. It finds a call
whose scalar argument is at most :data:`FILL_LIMIT` (``where``, ``masked_fill``, ``full``,
``fill``, ``mul``) and whose value reaches a softmax's input through mask arithmetic (adds,
wheres, views, expands, slices, dtype conversions), replaces that scalar with -65504, and
marks the fill and every node on its way to the softmax (:data:`MASK_PATH`): the ranges rule
does not count the fill's magnitude there (``passes/ranges.py``), and the deployment rule
gives the fill rule "mask_fill" and its reason (``passes/deploy.py``). A fully padded row
is uniform in true FP16 while its scores stay within 16 of each other's rounding at 65504
(FP16's spacing there is 32); onnxruntime's CPU provider, which runs the add in FP32, keeps
the scores' differences on such a row instead. The original value is kept in the node's
meta (``op_args.keep_fp32_values``), so the FP32 reference an exported file is checked
against computes what the model computes; :data:`MASK_FILL` names the fill for its plan
reason.
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .. import ops
from ..op_args import keep_fp32_values
from ..policy import Policy, is_deploy
from . import PassResult
from .manager import PassContext

log = logging.getLogger(__name__)

#: a scalar at or below this is a mask fill (finfo(float32).min, -inf, -1e9, -1e4 ...)
FILL_LIMIT = -1e4
#: what a fill is written as: FP16's lowest finite value
FP16_LOWEST = float(torch.finfo(torch.float16).min)
#: node meta: (argument position or keyword, the model's own fill value) of a rewritten fill
MASK_FILL = "fxamp_mask_fill"
#: node meta: True on a fill and on every node between it and the softmax it masks
MASK_PATH = "fxamp_mask_path"

_FILLS = {"where", "masked_fill", "masked_fill_", "full", "full_like", "fill", "fill_",
          "new_full", "mul", "scalar_tensor"}
#: ops a mask goes through on its way to the softmax
_CARRY = {"add", "add_", "iadd", "sub", "where", "masked_fill", "expand", "expand_as", "view",
          "reshape", "unsqueeze", "squeeze", "slice", "select", "permute", "transpose",
          "contiguous", "clone", "to", "_to_copy", "type_as", "float", "half", "alias",
          "getitem", "clamp", "clamp_min", "maximum", "minimum", "repeat", "broadcast_to",
          "triu", "tril"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
#: how far (in nodes) a fill may be from the softmax it masks
_MAX_DEPTH = 16


def _op(node: fx.Node, gm: nn.Module) -> str:
    """The node's bare op name ("" for a module other than Softmax)."""
    if node.op == "call_module":
        module = ops.module_of(node, gm)
        return "softmax" if isinstance(module, (nn.Softmax, nn.LogSoftmax)) else ""
    if node.op not in ("call_function", "call_method"):
        return ""
    if node.target is operator.getitem:
        return "getitem"
    return ops.name(node)


def _fill_arg(node: fx.Node) -> Optional[Tuple[Union[int, str], float]]:
    """(position or keyword, value) of the node's scalar argument at or below FILL_LIMIT."""
    items: List[Tuple[Union[int, str], Any]] = list(enumerate(node.args))
    items += list(node.kwargs.items())
    for key, value in items:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value <= FILL_LIMIT or (isinstance(value, float) and math.isinf(value)
                                    and value < 0):
            return key, float(value)
    return None


def _path_to_softmax(fill: fx.Node, gm: nn.Module) -> Set[fx.Node]:
    """The nodes on the ways from ``fill`` to a softmax's input through mask arithmetic
    (``fill`` and the softmax included); empty when it reaches none, or when a value on the
    way is also used elsewhere (there the fill's own value may matter)."""
    reach: Dict[fx.Node, int] = {fill: 0}
    order = [fill]
    softmaxes: List[fx.Node] = []
    for node in order:
        depth = reach[node]
        for user in node.users:
            if user in reach or depth >= _MAX_DEPTH:
                continue
            name = _op(user, gm)
            if name in _SOFTMAX:
                if user.args and user.args[0] is node:  # its input, not its dim or dtype
                    reach[user] = depth + 1
                    softmaxes.append(user)
            elif name in _CARRY:
                reach[user] = depth + 1
                order.append(user)
    on_path: Set[fx.Node] = set()
    todo = list(softmaxes)
    while todo:
        node = todo.pop()
        if node in on_path:
            continue
        on_path.add(node)
        todo.extend(a for a in node.all_input_nodes if a in reach)
    if any(u not in on_path for n in on_path - set(softmaxes) for u in n.users):
        return set()
    return on_path


def mask_fills(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Write each attention-mask fill (see the module doc) as FP16's lowest finite value and
    mark the mask's way to the softmax. Runs for a deployment plan in FP16 only."""
    modified = False
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or _op(node, gm) not in _FILLS:
            continue
        found = _fill_arg(node)
        if found is None or MASK_FILL in node.meta:
            continue
        path = _path_to_softmax(node, gm)
        if not path:
            continue
        key, value = found
        before = (node.args, dict(node.kwargs))
        if isinstance(key, int):
            args = list(node.args)
            args[key] = FP16_LOWEST
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, key: FP16_LOWEST}
        keep_fp32_values(node, *before)  # (the FP32 reference computes the model's fill)
        node.meta[MASK_FILL] = (key, value)
        for member in path:
            member.meta[MASK_PATH] = True
        log.debug("%s: mask fill %g written as %g", node.name, value, FP16_LOWEST)
        modified = True
    return PassResult(gm, modified)


def _rewritten_fill(node: fx.Node, gm: nn.Module) -> Optional[Union[int, str]]:
    """The argument (position or keyword) :func:`mask_fills` writes as FP16's lowest on
    ``node``, or None when it rewrites nothing there."""
    if node.op not in ("call_function", "call_method") or _op(node, gm) not in _FILLS:
        return None
    found = _fill_arg(node)
    if found is None or not _path_to_softmax(node, gm):
        return None
    return found[0]


def settles(node: fx.Node, key: Union[int, str]) -> bool:
    """Whether argument ``key`` of ``node`` is a value the pass makes the plan do without:
    the scalar of a fill it rewrites, or the ``dtype`` of a factory (``zeros``, ``full``...)
    whose every use is such a fill (the fill computes in FP16, whatever that dtype). Where
    the FP32 trace's only values read from dtypes are these (``finfo(float32).min`` masks),
    the torch.export front end does without its export under autocast
    (``frontends/dtype_reads.py``).

    Args:
        node: a node of the captured graph, before the passes.
        key: the position or keyword of one of its arguments.

    Returns:
        True when autocast's value of that argument does not change the plan.
    """
    gm = node.graph.owning_module
    if gm is None:
        return False
    if _rewritten_fill(node, gm) == key:
        return True
    return (key == "dtype" and not node.all_input_nodes and bool(node.users)
            and all(_rewritten_fill(user, gm) is not None for user in node.users))


def applies(policy: Policy) -> bool:
    """Whether the pass runs for ``policy``: a deployment plan whose low dtype is FP16, the
    rule on (the policy item ``off:mask_fill`` keeps the model's fills, and the masks in
    FP32)."""
    return (is_deploy(policy.target) and policy.compute == torch.float16
            and policy.runs("mask_fill"))


def runs(ctx: PassContext) -> bool:
    """Whether the pass runs (:func:`applies` to the context's policy)."""
    return applies(ctx.policy)


def fill_reason(node: fx.Node) -> Optional[str]:
    """The plan's reason for a rewritten fill, None for any other node."""
    found = node.meta.get(MASK_FILL)
    if found is None:
        return None
    return (f"an attention mask's fill {found[1]:.3g} is written as fp16's lowest "
            f"{FP16_LOWEST:g}: exp gives 0 for both after the softmax, a fully padded row "
            "stays finite, and the mask arithmetic runs in fp16")
