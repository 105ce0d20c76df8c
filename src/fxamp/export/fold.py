"""Eval-time constant work folded out of the exported ONNX graph: BatchNormalization into the
Conv before it.

An inference BatchNorm is an affine map per channel, ``y = (x - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)``; after a Conv it folds into the Conv's weight and bias
(``W' = W * s``, ``b' = (b - mean) * s + beta``), as every ONNX deployment tool's file has
it. The fold is computed in FP32 from the FP32 master values (looking through the Casts that
made the FP16 weight and parameters, and through the zero bias the exporter builds for a Conv
without one: see :class:`fxamp.export.constants.Constants`), then rounded once to the Conv's
weight dtype. It runs on the exporter's unoptimised graph, before the optimizer's own fusion
(which would fold into the already-rounded FP16 weight). Only the ONNX file changes; the
plan's decisions are the same (the folded Conv keeps its own plan line).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Tuple

from .constants import FLOATS, Constants, drop_dead
from .onnx_metadata import NOTE, get_meta, set_meta
from .repairs import astype

log = logging.getLogger(__name__)


def folded(weight: Any, bias: Any, gamma: Any, beta: Any, mean: Any, var: Any,
           eps: float) -> Tuple[Any, Any]:
    """The Conv weight and bias with an inference BatchNorm folded in, in FP32 numpy (the one
    arithmetic of both folds, so their files agree bit for bit): ``s = gamma / sqrt(var +
    eps)``, ``W' = W * s``, ``b' = (b - mean) * s + beta`` (``bias`` None: zero).

    Args:
        weight: the Conv's FP32 weight (output channels first).
        bias: its FP32 bias, or None.
        gamma: the BatchNorm's scale.
        beta: its shift.
        mean: its running mean.
        var: its running variance.
        eps: its epsilon (taken as FP32, as the ONNX attribute holds it).

    Returns:
        (weight, bias), FP32.
    """
    import numpy as np

    scale = gamma / np.sqrt(var + np.float32(eps))
    new_w = weight * scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    old_b = bias if bias is not None else np.zeros_like(mean)
    return new_w, (old_b - mean) * scale + beta


def fold_batchnorm(model: Any) -> int:
    """Fold each inference BatchNormalization whose input is a Conv's output (read by it
    alone) into that Conv; return how many were folded."""
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    consts = Constants(model)
    producers = consts.producers
    readers: Dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    dropped = set()
    count = 0
    nodes = list(graph.node)  # (held: the ids below stay theirs)
    for bn in nodes:
        if bn.op_type != "BatchNormalization" or len(bn.output) != 1 or len(bn.input) != 5:
            continue
        conv = producers.get(bn.input[0])
        if (conv is None or conv.op_type != "Conv" or readers.get(conv.output[0], 0) != 1
                or conv.output[0] in outputs):
            continue
        values = [consts.value(n) for n in list(bn.input[1:]) + [conv.input[1]]]
        has_bias = len(conv.input) > 2 and bool(conv.input[2])
        bias = consts.value(conv.input[2]) if has_bias else None
        if any(v is None for v in values) or (has_bias and bias is None):
            continue
        (gamma, _), (beta, _), (mean, _), (var, _), (weight, wtype) = values  # type: ignore
        if wtype not in FLOATS or any(v[0].dtype != np.float32 for v in values):  # type: ignore
            continue
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        new_w, new_b = folded(weight, None if bias is None else bias[0].astype(np.float32),
                              gamma, beta, mean, var, eps)
        w_name, b_name = f"{conv.name}_fxamp_folded_w", f"{conv.name}_fxamp_folded_b"
        graph.initializer.append(numpy_helper.from_array(astype(new_w, wtype), w_name))
        graph.initializer.append(numpy_helper.from_array(astype(new_b, wtype), b_name))
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        conv.output[0] = bn.output[0]
        set_meta(conv, NOTE, (get_meta(conv, NOTE) or "") + f"BatchNormalization {bn.name} "
                 "folded into this Conv by fxamp. ")
        dropped.add(id(bn))
        count += 1
    if count:
        keep = [n for n in nodes if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(keep)
        _drop_unread(model)
    return count


def _drop_unread(model: Any) -> None:
    """Remove the nodes nothing reads any more (the old weight's Casts, the zero bias the
    exporter built: ONNX ops of the default domain have no side effects)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        nodes = list(graph.node)
        used = {i for n in nodes for i in n.input} | outputs
        keep = [n for n in nodes if n.domain not in ("", "ai.onnx") or set(n.output) & used]
        if len(keep) == len(nodes):
            break
        del graph.node[:]
        graph.node.extend(keep)
    drop_dead(model)
