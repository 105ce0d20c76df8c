"""Dtypes the model reads at run time, on the torch.export front end.

torch.export runs the forward once, in FP32, and bakes every Python value the code computes
into the graph. Where that value comes from a tensor's dtype, the FP32 trace freezes
what FP32 gives, while under ``torch.autocast`` the same code sees a low-precision tensor:

- ``c.to(h.dtype)`` / ``c.to(h)``: ``aten.to.dtype(c, torch.float32)`` in the graph, a
  no-op there; under autocast, where ``h`` is a Linear's output, a cast to bf16;
- ``y.to(x.device)``: torch.export fills in ``y``'s traced dtype
  (``aten.to.dtype_layout(y, dtype=torch.float32, ...)``), which casts a bf16 ``y`` back to
  FP32 at run time;
- ``torch.finfo(scores.dtype).min``: FP32's minimum, which cannot be written into a bf16
  tensor (``masked_fill`` raises) and is not the value autocast's run fills in.

So when the FP32 graph has such values (FP32 as a dtype argument, or one of FP32's ``finfo``
constants), the model is exported a second time under ``torch.autocast`` (the device of the
inputs, the plan's compute dtype; the same dynamic shapes, so that both graphs spell sizes
alike), the two graphs are matched node by node (:func:`.modes.align`, with
:class:`RunTimeReads` saying what may differ), and every
argument that differs takes the autocast trace's value: each node is then planned as what
autocast does with the run-time dtype. Where a no-op ``to`` of the FP32 trace stands for the
tensor itself (the tracer hands the same tensor on under the ``to`` node's name), a use that
reads the tensor under autocast is pointed back at the tensor.

Where the two graphs do not match (the code branches on a dtype), the FP32 graph is kept and
a warning names the first node that differs and its source line. A device without autocast
(``meta``) keeps the FP32 graph, with a warning where the graph has such values.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import tree_flatten
from ..errors import source_line
from ..op_args import keep_fp32_values
from . import dtype_probe
from .modes import Alignment, align, node_arguments

__all__ = ["follow_run_time_dtypes", "RunTimeReads", "Settled"]

log = logging.getLogger(__name__)

#: ATen spellings of ``Tensor.to`` a non-strict export records: on a tensor that already
#: has the dtype they are no-ops that return the tensor itself
_TO = tuple(getattr(torch.ops.aten.to, name) for name in ("dtype", "dtype_layout", "device",
                                                          "other")
            if hasattr(torch.ops.aten.to, name))
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: ops ``torch.autocast`` casts to the low dtype on every device (its matmuls and
#: convolutions): an FP32 input and the same values in the low dtype give them one result
_LOWERED = frozenset(getattr(torch.ops.aten, name).default for name in (
    "linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "conv1d", "conv2d", "conv3d")
    if hasattr(torch.ops.aten, name))
#: the metadata assertion a non-strict export records before a ``to``
_ASSERT_METADATA = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
_ASSERT_METADATA = _ASSERT_METADATA.default if _ASSERT_METADATA is not None else None
#: the constants ``torch.finfo(x.dtype)`` gives for an FP32 ``x``
_FP32_CONSTANTS = frozenset(float(getattr(torch.finfo(torch.float32), name))
                            for name in ("min", "max", "eps", "tiny"))


def _may_read_dtype(value: Any) -> bool:
    """An argument value of the FP32 trace that may come from a tensor's dtype: FP32 itself,
    or one of FP32's ``finfo`` constants (``finfo(x.dtype).min``, ``eps``...)."""
    if isinstance(value, (list, tuple)):
        return any(_may_read_dtype(v) for v in value)
    if isinstance(value, torch.dtype):
        return value == torch.float32
    return type(value) is float and value in _FP32_CONSTANTS


#: ``settled(node, key)``: whether the plan reads argument ``key`` (a position or a keyword)
#: of ``node`` as the FP32 trace has it or not at all, so autocast's value of it is not needed
Settled = Callable[[fx.Node, Union[int, str]], bool]


def dtype_values(graph: fx.Graph, settled: Optional[Settled] = None
                 ) -> List[Tuple[fx.Node, Union[int, str]]]:
    """(node, position or keyword) of each argument of a call in ``graph`` that may come
    from a tensor's dtype, less those ``settled`` says the plan does not need."""
    found: List[Tuple[fx.Node, Union[int, str]]] = []
    for node in (n for n in graph.nodes if n.op == "call_function"):
        items: List[Tuple[Union[int, str], Any]] = [*enumerate(node.args),
                                                    *node.kwargs.items()]
        found += [(node, key) for key, value in items if _may_read_dtype(value)
                  and not (settled is not None and settled(node, key))]
    return found


def has_dtype_values(graph: fx.Graph, settled: Optional[Settled] = None) -> bool:
    """Whether any call in ``graph`` has an argument that may come from a tensor's dtype
    (and that ``settled`` does not say the plan does without)."""
    return bool(dtype_values(graph, settled))


def _noop_to_source(node: Any) -> Optional[fx.Node]:
    """The tensor a no-op ``to`` of the FP32 trace stands for (same dtype in and out)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _TO
            and node.args and isinstance(node.args[0], fx.Node)):
        return None
    out, src = node.meta.get("val"), node.args[0].meta.get("val")
    if isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) \
            and out.dtype == src.dtype:
        return node.args[0]
    return None


class RunTimeReads(Alignment):
    """The FP32 graph matched with the graph traced under autocast: what may differ is a
    floating dtype and a float constant (each a value read from a tensor's dtype), and a
    no-op ``to`` standing for its tensor; ``changes`` holds ``(node, index, value)``: the
    autocast trace's value of argument ``index``, and ``rewires`` holds
    ``(node, no-op to, tensor)``: a use to point back at the tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.rewires: List[Tuple[fx.Node, fx.Node, fx.Node]] = []
        self._user: Optional[fx.Node] = None

    def compare(self, a: fx.Node, b: fx.Node, roots: Tuple[nn.Module, nn.Module]) -> bool:
        self._user, kept = a, len(self.rewires)
        try:
            if super().compare(a, b, roots):
                return True
            del self.rewires[kept:]  # (nothing is recorded for a pair that does not match)
            return False
        finally:
            self._user = None

    def same_value(self, a: Any, b: Any) -> bool:
        if super().same_value(a, b):
            return True
        source = _noop_to_source(a) if isinstance(b, fx.Node) else None
        if source is not None and self._user is not None \
                and self.resolve(source) is self.match.get(b):
            self.rewires.append((self._user, a, source))
            return True
        return False

    def skip(self, others: List[fx.Node], j: int) -> int:
        """Past the casts to FP32 that only the autocast trace has (in FP32 they are no-ops
        the trace leaves out: PEFT's ``x.to(lora_A.weight.dtype)`` of a bf16 activation),
        each with its metadata assertion, where every use of the cast is an op autocast
        casts to the low dtype anyway (a Linear): there the cast changes no value, so the
        FP32 graph, which reads the tensor itself, computes what autocast computes. Each
        stands for its input."""
        k = j
        while k < len(others):
            node = others[k]
            if node.op == "call_function" and node.target is _ASSERT_METADATA \
                    and k + 1 < len(others) and self._lowered_upcast(others[k + 1]):
                k += 1
                continue
            if not self._lowered_upcast(node):
                break
            self.match[node] = self.match[node.args[0]]
            k += 1
        return k

    def _lowered_upcast(self, node: fx.Node) -> bool:
        """Whether ``node`` (of the autocast trace) casts a matched tensor to FP32 for uses
        that autocast all casts to the low dtype."""
        return (node.op == "call_function" and node.target in _TO
                and isinstance(node.args[0], fx.Node) and node.args[0] in self.match
                and torch.float32 in (*node.args[1:], *node.kwargs.values())
                and bool(node.users)
                and all(u.op == "call_function" and u.target in _LOWERED for u in node.users))

    def change(self, a: fx.Node, b: fx.Node, index: int, va: Any, vb: Any) -> Optional[Any]:
        if (va in _FLOATS and vb in _FLOATS) or (type(va) is float and type(vb) is float):
            return (a, index, vb)
        return None


def follow_run_time_dtypes(gm: fx.GraphModule, model: nn.Module, args: tuple,
                           compute: Optional[torch.dtype],
                           trace: Callable[[], fx.GraphModule],
                           settled: Optional[Settled] = None,
                           run: Optional[Callable[[], Any]] = None) -> int:
    """Give ``gm`` (the FP32 export of ``model`` called with ``args``) the values autocast's
    run reads from tensors' dtypes (see the module docstring); ``trace`` exports the model
    again (the same dynamic shapes and mode). ``settled``: the arguments the plan does
    without (a deployment plan's attention-mask fills, which it writes itself): a graph
    whose every such value is settled is not exported again. ``run``: one eager forward of
    the model in the graph's mode, on its own copies of the inputs, where such a run changes
    nothing (None otherwise): conversions that it shows convert the same under autocast are
    settled too (:mod:`.dtype_probe`). Returns how many arguments changed."""
    found = dtype_values(gm.graph, settled) if compute is not None else []
    if not found:
        return 0
    name = type(model).__name__
    device = _device_type(model, args)
    if device in ("cpu", "cuda"):
        found = _unsettled(gm, found, device, compute, run)
        if not found:
            log.debug("%s: every value that may come from a dtype reads the same under "
                      "torch.autocast (one eager run); no export under autocast", name)
            return 0
    if device not in ("cpu", "cuda"):
        first = found[0][0]
        log.warning("%s: %s has a dtype or a float constant that may come from a tensor's "
                    "dtype (%s); on %s there is no torch.autocast to trace what it is at run "
                    "time, so it keeps the FP32 trace's value; what to do: rewrite with "
                    "example inputs on the device the model trains on", name, first.name,
                    source_line(first) or "source unknown", device)
        return 0
    try:
        with torch.autocast(device, compute):
            other = trace()
    except Exception as err:  # noqa: BLE001 - the FP32 graph stays; autocast's own run fails
        log.info("%s: no export under torch.autocast (%s: %s); dtypes read at run time keep "
                 "the FP32 trace's values", name, type(err).__name__, err)
        return 0
    reads = RunTimeReads()
    if align(gm.graph, other.graph, (gm, other), reads) is None:
        log.warning("%s computes other ops under torch.autocast than in FP32 (it branches on a "
                    "dtype%s); the graph follows the FP32 trace: where the code reads a "
                    "tensor's dtype, the rewritten model keeps FP32's value", name,
                    _first_difference(gm.graph, other.graph))
        return 0
    for user, noop, source in reads.rewires:
        user.replace_input_with(noop, source)
    for node, index, value in reads.changes:
        found = _write(node, index, value)
        log.debug("%s: %s argument %d follows the run-time dtype: %r", name, node.name, index,
                  found)
    if reads.changes or reads.rewires:
        log.info("%s: %d values read from tensors' dtypes follow autocast's run (%s)", name,
                 len(reads.changes) + len(reads.rewires),
                 ", ".join(sorted({n.name for n, _, _ in reads.changes})))
        gm.graph.lint()
        gm.recompile()
    return len(reads.changes) + len(reads.rewires)


def _unsettled(gm: fx.GraphModule, found: List[Tuple[fx.Node, Union[int, str]]],
               device: str, compute: torch.dtype, run: Optional[Callable[[], Any]]
               ) -> List[Tuple[fx.Node, Union[int, str]]]:
    """``found`` less the conversions :mod:`.dtype_probe` settles: those whose value only
    reaches ops autocast casts anyway, then (when only conversions are left and ``run`` may
    be made) those the eager autocast run shows convert the same."""
    found = [(n, k) for n, k in found
             if not (n.target in _TO and dtype_probe.reaches_lower_only(n, device))]
    if not found or run is None or any(n.target not in _TO for n, _ in found) \
            or dtype_probe.writes_state(gm.graph):
        return found
    seen = dtype_probe.conversions(run, device, compute)
    if seen is None:
        return found
    return [(n, k) for n, k in found if not dtype_probe.settled_by_run(n, seen)]


def _write(node: fx.Node, index: int, value: Any) -> Any:
    """Set argument ``index`` (by the node's schema) of ``node`` to ``value``."""
    found = node_arguments(node)
    assert found is not None
    values, write, _ = found
    before = (node.args, dict(node.kwargs))
    values[index] = value
    write(values)
    keep_fp32_values(node, *before)  # (FP32 runs of the graph, the ranges', put it back)
    return value


def _device_type(model: nn.Module, args: tuple) -> str:
    """The device type the call runs on: its first tensor argument's, else the model's."""
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.device.type
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device.type
    return "cpu"


def _tensor_calls(graph: fx.Graph) -> List[fx.Node]:
    """The calls of ``graph`` that compute tensors (not sizes, not checks)."""
    return [n for n in graph.nodes if n.op == "call_function"
            and isinstance(n.meta.get("val"), torch.Tensor)]


def _first_difference(a: fx.Graph, b: fx.Graph) -> str:
    """``": first at NODE, SOURCE"`` for the first tensor call that differs between the
    graphs (by its op), or ""."""
    calls_a, calls_b = _tensor_calls(a), _tensor_calls(b)
    for x, y in zip(calls_a, calls_b):
        if x.target != y.target:
            line = source_line(x)
            return f": first at {x.name}" + (f", {line}" if line else "")
    return ""
