"""The true-FP16 run at a bounded cost: intermediates freed, a huge output sampled.

``onnx.reference.ReferenceEvaluator.run`` keeps every intermediate value of the graph until
it returns (GPT-2 small at 2x128: 2.6 GB more). :func:`run_bounded` runs the same
evaluator's nodes in order and drops each value after its last use, so only the live
values are held.

An output of more than :data:`SAMPLE_LIMIT` values (a language model's logits: 2x128x50257)
is evaluated on a sample when it is a projection by a constant matrix (``MatMul`` or
``Gemm`` with a weight computed from initializers alone), followed only by ``Cast`` /
``Identity`` nodes: the projection computes every ``stride``-th column of its weight
(:class:`Sampled`), each one exactly as the whole product would (a column of a matrix
product depends on that column of the weight alone). The check compares that sample with
the same columns of the FP32 output; the file's metadata says what was sampled
(``fxamp.true_fp16_sampled``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

log = logging.getLogger(__name__)

#: the most values of one output the true-FP16 check evaluates (a projection's larger
#: outputs are sampled by columns)
SAMPLE_LIMIT = 1 << 20

#: ops that pass a sampled projection's columns on unchanged, element by element
_PASS = frozenset({"Cast", "Identity"})


@dataclass(frozen=True)
class Sampled:
    """An output evaluated on every ``stride``-th position of its last axis.

    Attributes:
        output: the graph output's name.
        stride: the step along the last axis (the sample is ``value[..., ::stride]``).
        evaluated: how many values were evaluated.
        total: how many values the whole output has.
    """

    output: str
    stride: int
    evaluated: int
    total: int

    def text(self) -> str:
        """One line for the file's metadata and the log."""
        return (f"{self.output}: every {self.stride}th column of its last axis "
                f"({self.evaluated} of {self.total} values)")


@dataclass
class BoundedRun:
    """The outputs of :func:`run_bounded` and what it sampled.

    Attributes:
        outputs: the graph's outputs in order (a sampled one holds its sample only).
        sampled: output position -> how it was sampled.
        freed: how many intermediate values were dropped after their last use.
    """

    outputs: List[Any]
    sampled: Dict[int, Sampled] = field(default_factory=dict)
    freed: int = 0


def _constants(graph: Any) -> Set[str]:
    """The values of ``graph`` computed from initializers alone (no graph input)."""
    known = {i.name for i in graph.initializer}
    for node in graph.node:
        if any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute):
            continue
        if all(not name or name in known for name in node.input):
            known.update(o for o in node.output if o)
    return known


def _consumers(graph: Any) -> Dict[str, int]:
    """Value name -> how many node inputs read it."""
    count: Dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                count[name] = count.get(name, 0) + 1
    return count


def projections(proto: Any) -> Dict[str, str]:
    """The projections whose output may be sampled: the output value of each ``MatMul`` /
    ``Gemm`` by a constant 2-D weight that reaches a graph output through ``Cast`` /
    ``Identity`` nodes alone, each value on the way read once -> that graph output.

    Args:
        proto: the ONNX model.

    Returns:
        Projection output value -> graph output name.
    """
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    consumers = _consumers(graph)
    outputs = [o.name for o in graph.output]
    constants = _constants(graph)
    found: Dict[str, str] = {}
    for out in outputs:
        name, node = out, producer.get(out)
        while node is not None and node.op_type in _PASS and len(node.input) == 1:
            name = node.input[0]
            if consumers.get(name, 0) != 1 or name in outputs:
                node = None
                break
            node = producer.get(name)
        if node is None or node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 \
                or node.input[1] not in constants or node.input[0] in constants:
            continue
        if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
            continue
        found[node.output[0]] = out
    return found


def _sample_weight(node: Any, inputs: List[Any], limit: int) -> Optional[Tuple[int, int]]:
    """The stride to sample ``node``'s output columns with and their number (its weight,
    ``inputs[1]``, and a Gemm's bias sliced in place), or None when the whole output is
    within ``limit``."""
    a, b = inputs[0], inputs[1]
    if getattr(b, "ndim", 0) != 2 or getattr(a, "ndim", 0) < 1:
        return None
    trans_b = node.onnx_node.op_type == "Gemm" and bool(getattr(node, "transB", 0))
    columns = b.shape[0] if trans_b else b.shape[1]
    rows = math.prod(a.shape[:-1])
    if rows * columns <= limit or columns < 2:
        return None
    stride = math.ceil(rows * columns / max(limit, 1))
    inputs[1] = b[::stride] if trans_b else b[:, ::stride]
    if len(inputs) > 2 and getattr(inputs[2], "ndim", 0) and inputs[2].shape[-1] == columns:
        inputs[2] = inputs[2][..., ::stride]
    return stride, columns


def _simple(evaluator: Any) -> bool:
    """Whether the evaluator's nodes can run one by one here: none needs the context of
    the run (subgraphs: ``If``, ``Loop``, ``Scan``) and no shapes are checked."""
    if getattr(evaluator, "check_shape_annotations_", False):
        return False
    return not any(node.need_context() or getattr(node, "has_linked_attribute", False)
                   for node in evaluator.rt_nodes_)


def run_bounded(proto: Any, feed: Dict[str, Any], limit: Optional[int] = None
                ) -> BoundedRun:
    """Run ``proto`` in true FP16 (``reference_ops.evaluator``), holding only the values
    still to be read and sampling the outputs of more than ``limit`` values that
    :func:`projections` allows.

    Args:
        proto: the ONNX model.
        feed: input name -> numpy array.
        limit: the most values of one sampled output (default :data:`SAMPLE_LIMIT`).

    Returns:
        The outputs and what was sampled; a graph with subgraphs runs whole, unsampled.
    """
    from .reference_ops import evaluator as make_evaluator

    limit = SAMPLE_LIMIT if limit is None else limit
    evaluator = make_evaluator(proto)
    if not _simple(evaluator):
        return BoundedRun(list(evaluator.run(None, feed)))
    outputs = [o.name for o in proto.graph.output]
    keep = set(outputs)
    nodes = evaluator.rt_nodes_
    last: Dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            last[name] = index
    sample = projections(proto)
    strides: Dict[str, Tuple[int, int]] = {}  # value -> its sample's (stride, columns)
    results: Dict[str, Any] = {"": None}
    results.update(evaluator.rt_inits_)
    results.update(feed)
    inits = set(evaluator.rt_inits_)
    freed = 0
    for index, node in enumerate(nodes):
        inputs = [results[name] for name in node.input]
        cut = _sample_weight(node, inputs, limit) if node.output[0] in sample else None
        if cut is None and len(node.input) == 1 and node.input[0] in strides:
            cut = strides[node.input[0]]  # (a Cast on the sampled path)
        values = node.run(*inputs)
        for name, value in zip(node.output, values):
            results[name] = value
            if cut is not None:
                strides[name] = cut
        for name in set(node.input):
            if name and last.get(name) == index and name not in keep and name not in inits \
                    and name in results:
                del results[name]
                freed += 1
    run = BoundedRun([results[name] for name in outputs], freed=freed)
    for position, name in enumerate(outputs):
        if name in strides:
            stride, columns = strides[name]
            got = run.outputs[position]
            run.sampled[position] = Sampled(name, stride, int(got.size),
                                            int(math.prod(got.shape[:-1]) * columns))
            log.info("the true-FP16 check evaluates %s", run.sampled[position].text())
    return run


def sampled_like(want: Any, sampled: Optional[Sampled]) -> Any:
    """``want`` (the FP32 output) cut as ``sampled`` cut the file's output.

    Args:
        want: the FP32 reference's output (a tensor or array).
        sampled: how the file's output was sampled (None: whole).

    Returns:
        ``want[..., ::stride]``, or ``want`` itself.
    """
    if sampled is None:
        return want
    return want[..., ::sampled.stride]


#: the file's metadata keys: the export's true-FP16 result per output (JSON rows of
#: ``verify.true_fp16_row``), the digest of the inputs it was measured on, and what it
#: sampled
ROWS_KEY = "fxamp.true_fp16_rows"
DIGEST_KEY = "fxamp.true_fp16_inputs"
SAMPLED_KEY = "fxamp.true_fp16_sampled"


def inputs_digest(arrays: Sequence[Any]) -> str:
    """A digest of input values (their dtypes, shapes and bytes, in order): what says the
    precision report runs on the inputs the export checked.

    Args:
        arrays: the inputs, as numpy arrays or tensors.

    Returns:
        A hex digest.
    """
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for value in arrays:
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        array = np.ascontiguousarray(np.asarray(value))
        digest.update(f"{array.dtype.str}{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:32]
