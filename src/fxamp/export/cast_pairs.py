"""Casts only at real precision boundaries in the exported ONNX graph.

The exporter writes each ``.to(dtype)`` of the rewritten graph as a Cast; where the plan's
boundaries meet (a value cast up for one island and back down for the next), the file can hold
Casts that do nothing or cancel. :func:`simplify_casts` removes, exactly (never a change of
value):

* a Cast to the type its input already has;
* a Cast back to the original type after a widening one (``fp16 -> fp32 -> fp16`` and
  ``bf16 -> fp32 -> bf16`` give back the same values; the narrowing pair ``fp32 -> fp16 ->
  fp32`` rounds, so it stays);
* a second Cast of the same value to the same type (its readers share the first).

A Cast that writes a graph output is kept (the outputs keep their declared types, FP32 like
the ONNX tools' ``keep_io_types``).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from .repairs import value_types

#: (from, to) pairs whose round trip gives back the same values: the narrow type into FP32
_WIDENING = {(10, 1), (16, 1)}


def _to(node: Any) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def simplify_casts(model: Any) -> int:
    """Remove Casts that do nothing, cancel or repeat; return how many were removed."""
    graph = model.graph
    types = value_types(model)
    outputs = {o.name for o in graph.output}
    producers = {o: n for n in graph.node for o in n.output}
    rename: Dict[str, str] = {}
    seen: Dict[Tuple[str, int], str] = {}
    removed = set()
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        if node.op_type != "Cast" or node.output[0] in outputs:
            continue
        src, to = node.input[0], _to(node)
        target = None
        if types.get(src) == to:
            target = src
        else:
            up = producers.get(src)
            if up is not None and up.op_type == "Cast" and id(up) not in removed:
                origin = up.input[0]
                if types.get(origin) == to and (to, _to(up)) in _WIDENING:
                    target = origin
        if target is None:
            key = (src, to)
            if key in seen:
                target = seen[key]
            else:
                seen[key] = node.output[0]
                continue
        rename[node.output[0]] = target
        removed.add(id(node))
    if not removed:
        return 0
    for out in graph.output:  # (a graph output is never renamed: its Cast was kept)
        assert out.name not in rename
    keep = [n for n in graph.node if id(n) not in removed]
    used = {i for n in keep for i in n.input} | outputs
    keep = [n for n in keep if n.op_type != "Cast" or set(n.output) & used
            or id(n) in removed]
    count = len(graph.node) - len(keep)
    del graph.node[:]
    graph.node.extend(keep)
    return count
