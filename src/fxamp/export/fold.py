"""Eval-time constant work folded out of the exported ONNX graph: BatchNormalization into the
Conv before it.

An inference BatchNorm is an affine map per channel, ``y = (x - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)``; after a Conv it folds into the Conv's weight and bias
(``W' = W * s``, ``b' = (b - mean) * s + beta``), as every ONNX deployment tool's file has
it. The fold is computed in FP64 from the FP32 master values (looking through the Cast that
made an FP16 weight), then rounded once to the Conv's weight dtype. Only the ONNX file
changes; the plan's decisions are the same (the BatchNorm's plan line maps to the Conv).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

from .repairs import NOTE, astype, get_meta, set_meta

log = logging.getLogger(__name__)

_FLOATS = (1, 10, 16)


def _constant(name: str, inits: Dict[str, Any], producers: Dict[str, Any]
              ) -> Optional[Tuple[Any, int]]:
    """(FP64 value, ONNX dtype it has in the graph) of an initializer, or of a Cast of one."""
    from onnx import numpy_helper

    if name in inits:
        init = inits[name]
        return numpy_helper.to_array(init).astype("float64"), init.data_type
    node = producers.get(name)
    if node is not None and node.op_type == "Cast" and node.input[0] in inits:
        to = next(a.i for a in node.attribute if a.name == "to")
        return numpy_helper.to_array(inits[node.input[0]]).astype("float64"), to
    return None


def fold_batchnorm(model: Any) -> int:
    """Fold each inference BatchNormalization whose input is a Conv's output (read by it
    alone) into that Conv; return how many were folded."""
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    readers: Dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    dropped = set()
    folded = 0
    for bn in list(graph.node):
        if bn.op_type != "BatchNormalization" or len(bn.output) != 1 or len(bn.input) != 5:
            continue
        conv = producers.get(bn.input[0])
        if (conv is None or conv.op_type != "Conv" or readers.get(conv.output[0], 0) != 1
                or conv.output[0] in outputs):
            continue
        values = [_constant(n, inits, producers) for n in list(bn.input[1:]) + [conv.input[1]]]
        bias = _constant(conv.input[2], inits, producers) if len(conv.input) > 2 and \
            conv.input[2] else None
        if any(v is None for v in values) or (len(conv.input) > 2 and conv.input[2]
                                              and bias is None):
            continue
        (gamma, _), (beta, _), (mean, _), (var, _), (weight, wtype) = values  # type: ignore
        if wtype not in _FLOATS:
            continue
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        scale = gamma / np.sqrt(var + eps)
        new_w = weight * scale.reshape((-1,) + (1,) * (weight.ndim - 1))
        old_b = bias[0] if bias is not None else np.zeros_like(mean)
        new_b = (old_b - mean) * scale + beta
        w_name, b_name = f"{conv.name}_fxamp_folded_w", f"{conv.name}_fxamp_folded_b"
        graph.initializer.append(numpy_helper.from_array(
            astype(new_w.astype(np.float32), wtype), w_name))
        graph.initializer.append(numpy_helper.from_array(
            astype(new_b.astype(np.float32), wtype), b_name))
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        conv.output[0] = bn.output[0]
        set_meta(conv, NOTE, (get_meta(conv, NOTE) or "") + f"BatchNormalization {bn.name} "
                 "folded into this Conv by fxamp. ")
        dropped.add(id(bn))
        folded += 1
    if folded:
        keep = [n for n in graph.node if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(keep)
        _drop_dead(model)
    return folded


def _drop_dead(model: Any) -> None:
    """Remove Cast nodes and initializers nothing reads any more."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if n.op_type == "Cast" and not set(n.output) & used]
        if not dead:
            break
        ids = {id(n) for n in dead}
        keep = [n for n in graph.node if id(n) not in ids]
        del graph.node[:]
        graph.node.extend(keep)
    used = {i for n in graph.node for i in n.input} | outputs
    alive = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(alive)
