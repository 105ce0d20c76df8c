"""Layout pass: 2-D convolutions in NHWC (policy ``channels_last=on``).

The rewritten module shares the model's Parameters, so the conv weights are converted where
they live: ``p.data = p.data.contiguous(memory_format=torch.channels_last)``, the same Parameter
objects (what ``model.to(memory_format=torch.channels_last)`` does). Their per-forward casts to
FP16/BF16 keep the layout (``Tensor.to`` preserves it) and their FP32 gradients come back
channels_last, so nothing is copied to change layout during training. The graph's 4-D floating
inputs are made channels_last on entry by the casts pass (:func:`channels_last_inputs`); the
convolutions and the ops after them then run in NHWC.
"""
from __future__ import annotations

import logging
from typing import List

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import PassResult, fetch_attr
from .. import ir, ops
from .manager import PassContext

log = logging.getLogger(__name__)

_CONV2D_MODULES = (nn.Conv2d, nn.ConvTranspose2d)
_CONV2D_FUNCTIONS = {F.conv2d, torch.conv2d, F.conv_transpose2d, torch.conv_transpose2d,
                     # torch.export graphs (frontend="export") call the ATen ops
                     torch.ops.aten.conv2d.default, torch.ops.aten.convolution.default,
                     torch.ops.aten.conv_transpose2d.input}


def _conv_weights(gm: fx.GraphModule) -> List[torch.Tensor]:
    """The 4-D weights of the graph's 2-D convolutions (modules and functional calls)."""
    found: List[torch.Tensor] = []
    for node in gm.graph.nodes:
        weight = None
        if ops.is_module(node, gm, _CONV2D_MODULES):
            weight = ops.module_of(node, gm).weight  # type: ignore[union-attr]
        elif ops.is_call(node, _CONV2D_FUNCTIONS):
            arg = ops.arg(node, "weight", 1)
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                weight = fetch_attr(gm, str(arg.target))
        if isinstance(weight, torch.Tensor) and weight.dim() == 4 and \
                all(weight is not w for w in found):
            found.append(weight)
    return found


def weights_to_channels_last(gm: fx.GraphModule) -> PassResult:
    """Put the 4-D conv weights of ``gm`` in channels_last memory format, in place (the same
    Parameter objects); ``modified`` is False when the graph has no 2-D convolution."""
    weights = _conv_weights(gm)
    if not weights:
        log.info("channels_last=on: %s has no 2-D convolution with a 4-D weight; the layout "
                 "is left as it is", type(gm).__name__)
        return PassResult(gm, modified=False)
    with torch.no_grad():
        for w in weights:
            if not w.is_contiguous(memory_format=torch.channels_last):
                w.data = w.data.contiguous(memory_format=torch.channels_last)
    log.info("channels_last=on: %d conv weights kept in channels_last memory format",
             len(weights))
    return PassResult(gm, modified=True)


def channels_last(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """The layout pass (policy ``channels_last=on``): conv weights in channels_last memory
    format (in place) and, when there are any, each 4-D floating input marked in the IR
    (``layout="channels_last"``) for the casts pass to convert on entry."""
    if not weights_to_channels_last(gm).modified:
        return PassResult(gm, modified=False)
    for node in channels_last_inputs(gm):
        ir.set(node, layout="channels_last")
    return PassResult(gm, modified=True)


def channels_last_inputs(gm: fx.GraphModule) -> List[fx.Node]:
    """The placeholders whose value is a 4-D floating tensor (converted on entry)."""
    return [n for n in gm.graph.nodes if n.op == "placeholder" and ir.precision(n) is not None
            and ir.get(n).value == "tensor" and len((ir.get(n).shape or ())) == 4]
