"""Constant subgraphs of the exported ONNX graph, computed from the FP32 source values and
rounded once.

The exporter writes a weight as an FP32 initializer behind the plan's ``Cast`` to FP16, and
often more constant work after it: a ``Transpose`` of a Linear weight, a Conv's zero bias built
by ``Expand(CastLike(0, x), Shape(W)[:1])``. :class:`Constants` evaluates such a value from the
FP32 initializers, looking through the Casts: a float value is carried in FP32 (FP64 where the
source is FP64) with the ONNX type it has in the graph, so ``Transpose(Cast(W, fp16))`` is
``W.T`` in FP32, declared FP16. :func:`fold_constants` replaces each folded value that a
computing node reads by one initializer, the wide value rounded once to its declared type.
Moves, reshapes and elementwise arithmetic on constants are folded (the arithmetic in FP32);
a value is rounded to its declared type before it is cast to an integer type.

GatherElements is folded with :func:`.reference_ops.gather_elements` (the spec's gather, no
arithmetic), not ``onnx.reference``'s: that one (onnx 1.23) gathers with ``np.choose``, at most
64 choices, and fails on BERT's gather of its ``token_type_ids`` buffer (1, 512) at the
position ids (1, 128). Left to onnxscript's optimizer, whose constant folding evaluates it with
``onnx.reference``, that constant gather stayed a node and every BERT export logged
"Evaluation failed: cannot reshape array of size 1 into shape (1,128)"; this fold runs before
the optimizer (``onnx_passes.ONNX_STEPS``), so the optimizer never sees it.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Set, Tuple

from .repairs import astype, value_types

log = logging.getLogger(__name__)

#: ONNX float element types carried wide: FP32, FP16, BF16 (FP64 stays FP64)
FLOATS = (1, 10, 16)
_FP64 = 11
#: ops computed on the constant values (elementwise float ops on the wide values)
_FOLDABLE = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Concat", "Slice",
             "Gather", "Identity", "Flatten", "Mul", "Add", "Sub", "Div", "Neg", "Sqrt",
             "Reciprocal", "ConstantOfShape", "Range", "Split", "GatherElements"}
#: a folded value larger than this, and larger than the initializers it is computed from
#: (an ``Expand`` of a scalar to a big mask), stays a node
SIZE_LIMIT = 8192

Value = Tuple[Any, int]  # (numpy array: wide for floats, ONNX element type in the graph)


class Constants:
    """The constant values of ``model``'s main graph, evaluated on demand (memoised)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        graph = model.graph
        self.inits = {i.name: i for i in graph.initializer}
        self.nodes = list(graph.node)
        self.producers = {o: n for n in self.nodes for o in n.output}
        self.opsets = list(model.opset_import)
        self._types: Optional[Dict[str, int]] = None
        self._memo: Dict[str, Optional[Value]] = {}
        self._sources: Dict[str, int] = {}
        self._structural: Dict[str, bool] = {}

    def type_of(self, name: str) -> Optional[int]:
        if self._types is None:
            self._types = value_types(self.model)
        return self._types.get(name)

    def sources(self, name: str) -> int:
        """How many elements of initializers ``name`` is computed from."""
        return self._sources.get(name, 0)

    def constant(self, name: str) -> bool:
        """Whether ``name`` may be a constant, from the graph alone (no value computed): an
        initializer, a Constant node, or an op :meth:`value` computes on such inputs. A
        value :meth:`value` computes is always one; the weights a computing node reads
        are not widened to find that its other input is not.

        Args:
            name: a value of the graph.

        Returns:
            False where :meth:`value` is None for sure.
        """
        if not name or name in self.inits:
            return True
        if name not in self._structural:
            self._structural[name] = False  # (a cycle is not a constant)
            node = self.producers.get(name)
            ok = node is not None and node.domain in ("", "ai.onnx") and (
                node.op_type in _FOLDABLE or node.op_type in ("Constant", "Cast", "CastLike",
                                                             "Shape"))
            read = node.input[:1] if ok and node.op_type == "CastLike" else \
                (node.input if ok else [])
            self._structural[name] = ok and all(self.constant(i) for i in read)
        return self._structural[name]

    def value(self, name: str) -> Optional[Value]:
        """(wide value, ONNX type) of ``name``, or None when it is not a constant."""
        if not name:
            return None
        if name not in self._memo:
            self._memo[name] = None  # (a cycle is not a constant)
            self._memo[name] = self._compute(name)
        return self._memo[name]

    def rounded(self, name: str) -> Optional[Any]:
        """The value of ``name`` in its declared type (None when not a constant)."""
        got = self.value(name)
        return None if got is None else _round(*got)

    def _compute(self, name: str) -> Optional[Value]:
        from onnx import numpy_helper

        if name in self.inits:
            init = self.inits[name]
            self._sources[name] = _size(init.dims)
            return _widen(numpy_helper.to_array(init), init.data_type), init.data_type
        node = self.producers.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            return _constant_node(node)
        read = node.input[:1] if node.op_type == "CastLike" else node.input  # (its type only)
        inputs = [self.value(i) if i else (None, 0) for i in read]
        if any(v is None for v in inputs):
            return None
        self._sources[name] = sum(self.sources(i) for i in node.input if i)
        if node.op_type in ("Cast", "CastLike"):
            to = (next(a.i for a in node.attribute if a.name == "to") if node.op_type == "Cast"
                  else self.type_of(node.input[1]))
            array, dtype = inputs[0]  # type: ignore[misc]
            if to is None:
                return None
            if to in FLOATS + (_FP64,) and dtype in FLOATS + (_FP64,):
                return array, to  # no rounding until the value is written
            return _widen(_as_onnx(_round(array, dtype), to), to), to
        if node.op_type == "Shape":
            import numpy as np

            shape = np.array(inputs[0][0].shape, dtype=np.int64)  # type: ignore[index]
            attrs = {a.name: a.i for a in node.attribute}
            return shape[attrs.get("start", 0):attrs.get("end")], 7
        if node.op_type not in _FOLDABLE:
            return None
        if node.op_type == "GatherElements":
            return _gather_elements(node, inputs)
        return self._evaluate(node, name, inputs)

    def _evaluate(self, node: Any, name: str, inputs: List[Any]) -> Optional[Value]:
        """One node on the constant inputs (float inputs wide, of the same declared type)."""
        from onnx import helper
        from onnx.reference import ReferenceEvaluator

        floats = {t for _, t in inputs if t in FLOATS + (_FP64,)}
        if len(floats) > 1:
            return None
        feed = {i: v for i, (v, _) in zip(node.input, inputs) if i}
        try:
            fn = helper.make_function("fxamp.fold", "f", list(feed), list(node.output), [node],
                                      self.opsets)
            outs = ReferenceEvaluator(fn).run(None, feed, attributes={})
        except Exception as err:  # noqa: BLE001 - an op the evaluator lacks: not folded
            log.debug("not folded: %s (%s)", node.name, err)
            return None
        for out, array in zip(node.output, outs):
            if out != name:
                continue
            if array.dtype.kind == "f":
                dtype = floats.pop() if floats else _onnx_type(array)
                return _widen(array, dtype), dtype
            return array, _onnx_type(array)
        return None


def fold_constants(model: Any) -> int:
    """Replace every constant subgraph a computing node reads by one initializer (computed
    wide from the FP32 sources, rounded once); return how many values were written."""
    from onnx import numpy_helper

    graph = model.graph
    consts = Constants(model)  # (holds every node: their ids below stay theirs)
    outputs = {o.name for o in graph.output}
    folded: Set[int] = set()
    for node in consts.nodes:
        if node.op_type == "Constant" or not node.output or set(node.output) & outputs \
                or not all(consts.constant(o) for o in node.output):
            continue
        values = [consts.value(o) for o in node.output]
        if all(v is not None for v in values) and all(
                v[0].size <= max(SIZE_LIMIT, consts.sources(o))  # type: ignore[index]
                for o, v in zip(node.output, values)):
            folded.add(id(node))
    folded -= _shared_transposes(consts, folded)
    if not folded:
        return 0
    written = 0
    for node in consts.nodes:
        if id(node) in folded:
            continue
        for name in node.input:
            producer = consts.producers.get(name)
            if producer is None or id(producer) not in folded or name in consts.inits:
                continue
            graph.initializer.append(numpy_helper.from_array(consts.rounded(name), name))
            consts.inits[name] = graph.initializer[-1]
            written += 1
    keep = [n for n in consts.nodes if id(n) not in folded]
    del graph.node[:]
    graph.node.extend(keep)
    drop_dead(model)
    return written


def _shared_transposes(consts: Constants, folded: Set[int]) -> Set[int]:
    """The ids of the folded ``Transpose`` nodes to keep as nodes: those whose input is read
    by a node that stays too (a tied weight: an embedding's Gather table that the output
    projection reads transposed). Folded, the weight would be written twice, once as it is
    and once transposed; kept, the file holds it once and the Transpose reads it. The values
    are the same either way: a transpose moves the rounded values, it rounds nothing.

    Args:
        consts: the graph's constants (its nodes, in graph order).
        folded: the ids of the nodes to be folded.

    Returns:
        The ids of the Transposes to keep.
    """
    readers: Dict[str, List[Any]] = {}
    for node in consts.nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    keep: Set[int] = set()
    for node in consts.nodes:
        if id(node) not in folded or node.op_type != "Transpose" or not node.input:
            continue
        source = node.input[0]
        read_as_is = any(id(r) not in folded for r in readers.get(source, ()) if r is not node)
        read_moved = any(id(r) not in folded for o in node.output for r in readers.get(o, ()))
        if read_as_is and read_moved:
            keep.add(id(node))
    if keep:
        log.debug("%d transposed weight(s) also read as they are (tied): kept as Transpose "
                 "nodes, each weight stored once", len(keep))
    return keep


def drop_dead(model: Any) -> None:
    """Remove Cast and Constant nodes, and initializers, that nothing reads any more."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        nodes = list(graph.node)
        used = {i for n in nodes for i in n.input} | outputs
        keep = [n for n in nodes if n.op_type not in ("Cast", "Constant")
                or set(n.output) & used]
        if len(keep) == len(nodes):
            break
        del graph.node[:]
        graph.node.extend(keep)
    used = {i for n in graph.node for i in n.input} | outputs
    alive = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(alive)


def _gather_elements(node: Any, inputs: List[Value]) -> Optional[Value]:
    """A GatherElements node on constant inputs, with :func:`.reference_ops.gather_elements`
    (see the module doc): it moves values, so a float table is gathered wide and keeps its
    declared type, exactly.

    Args:
        node: the GatherElements node.
        inputs: its (data, indices) values, each (array, ONNX type).

    Returns:
        (gathered array, the data's ONNX type), or None (not folded) where the shapes are not
        the spec's or an index is out of range: the node stays, and onnxruntime says what is
        wrong when the file runs.
    """
    from .reference_ops import gather_elements

    if len(inputs) != 2:
        return None
    (data, onnx_type), (indices, _) = inputs
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    try:
        out = gather_elements(data, indices, axis)
    except IndexError as err:
        log.debug("not folded: %s (%s)", node.name, err)
        return None
    if out is None:
        log.debug("not folded: %s (data %s, indices %s, axis %d: not the spec's shapes)",
                  node.name, data.shape, indices.shape, axis)
        return None
    return out, onnx_type


def _constant_node(node: Any) -> Optional[Value]:
    """The value of a Constant node (a tensor, or a float / int list attribute)."""
    import numpy as np
    from onnx import helper, numpy_helper

    if len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value":
        return _widen(numpy_helper.to_array(attr.t), attr.t.data_type), attr.t.data_type
    kinds = {"value_float": (np.float32, 1), "value_floats": (np.float32, 1),
             "value_int": (np.int64, 7), "value_ints": (np.int64, 7)}
    if attr.name not in kinds:
        return None
    dtype, onnx_type = kinds[attr.name]
    return np.array(helper.get_attribute_value(attr), dtype=dtype), onnx_type


def _size(dims: Any) -> int:
    size = 1
    for d in dims:
        size *= int(d)
    return size


def _widen(array: Any, onnx_type: int) -> Any:
    """A float value in FP32 (FP64 stays FP64), exactly; other values as they are."""
    import numpy as np

    if onnx_type in FLOATS:
        return np.asarray(array).astype(np.float32, copy=False)
    return np.asarray(array)


def _round(array: Any, onnx_type: int) -> Any:
    """The wide value in its declared ONNX type (the one rounding)."""
    if onnx_type in FLOATS:
        return astype(array, onnx_type)
    return _as_onnx(array, onnx_type)


def _as_onnx(array: Any, onnx_type: int) -> Any:
    from onnx import helper

    if onnx_type in FLOATS:
        return astype(array, onnx_type)
    return array.astype(helper.tensor_dtype_to_np_dtype(onnx_type))


def _onnx_type(array: Any) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(array.dtype)
