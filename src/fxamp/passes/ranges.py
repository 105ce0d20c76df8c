"""Ranges pass (rule "ranges"): value ranges seen on calibration batches.

``collect_ranges`` runs the FP32 source graph on real batches (no grad; buffers such as
BatchNorm's running statistics are cloned, so the model is unchanged) and records per node the
largest magnitude, the fraction of non-zero values below the low dtype's smallest normal, and
the count of non-finite values. ``keep_in_range`` keeps in FP32 every node whose output — or
one of whose floating inputs — would pass the low dtype's largest value with a safety margin:
the node that overflows and the nodes it feeds until the values are back in range. bf16 has
FP32's range, so for bf16 only real overflows count. For a deployment target (``tensorrt``) the
example inputs are always a calibration batch, the margin is :data:`DEPLOY_MARGIN`, and a
called module whose weights pass the limit is kept in FP32 too. Nodes whose values mostly
underflow are reported (logged), not changed. Each output's statistics come from
:func:`tensor_stats`: reductions over reused buffers, the same numbers as masked copies of
every output would give (a vocabulary's logits are 50 MB a batch).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Iterable, NamedTuple, Optional, Tuple

import torch
import torch.fx as fx
from .._torch import is_input_guard, reparametrize_module, tree_flatten, tree_map

from ..config import CALIBRATION_FORMS
from ..errors import CalibrationDataError, node_error
from ..graph_run import GraphRun
from ..op_args import fp32_values
from ..plan import RangeStats
from .. import ir, ops
from ..ir import Decision, Rule
from ..policy import dtype_name, is_deploy
from ..progress import track
from .inner_values import Spread, inner_peak, row_spread
from .mask_fill import MASK_PATH
from .manager import PassContext
from .rule import DecisionRule, rule_pass

log = logging.getLogger(__name__)

MARGIN = 2.0  # keep values below max / MARGIN in the low dtype
#: a deployment plan's margin: its ranges come from a few example inputs, and an engine has
#: no loss scaler or overflow check behind it. FP16's max / 128 is 512 (ModelOpt AutoCast's
#: default ``data_max``): past it FP16's spacing is 0.5 or more, and a residual stream or a
#: scaled embedding there is where FP16 files lose accuracy (a T5 encoder's grown residual:
#: true-FP16 error 1.3x the FP32-kept file's at / 8, the same at / 128)
DEPLOY_MARGIN = 128.0


class TensorStats(NamedTuple):
    """One tensor's range statistics, on its values as FP32 (what ``t.float()`` holds)."""

    max_abs: Optional[float]  # the largest finite magnitude; None where no value is finite
    min_abs: Optional[float]  # the smallest finite magnitude; None where no value is finite
    nonzero: int  # how many finite values are not 0
    small: int  # how many of those are below ``tiny``
    nonfinite: int  # how many values are inf or NaN


#: elements per piece of a contiguous tensor that :func:`tensor_stats` reduces at a time: its
#: temporaries (1 MiB of FP32 magnitudes, 1 MiB of FP32 flags) stay in cache and are allocated
#: once, however large the tensor (a 50257-word vocabulary's logits or embedding)
CHUNK = 1 << 18


class Scratch:
    """Reused temporaries for :func:`tensor_stats`: FP32 buffers per device and slot, grown to
    the largest piece seen (:data:`CHUNK` elements, or a whole tensor whose values cannot be
    read as one flat run), so that a graph's statistics allocate each buffer once rather
    than fresh copies of every node's output."""

    def __init__(self) -> None:
        self.buffers: Dict[Tuple[torch.device, str], torch.Tensor] = {}

    def like(self, t: torch.Tensor, slot: str) -> torch.Tensor:
        """A contiguous FP32 scratch tensor of ``t``'s shape on its device.

        Args:
            t: the tensor whose shape and device the scratch tensor takes.
            slot: which buffer (two slots' views never overlap).

        Returns:
            A view of this slot's buffer on ``t``'s device; its values are garbage.
        """
        key = (t.device, slot)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = self.buffers[key] = torch.empty(t.numel(), dtype=torch.float32,
                                                  device=t.device)
        return buf[:t.numel()].view(t.shape)


def _masked_stats(t: torch.Tensor, tiny: float) -> TensorStats:
    """:func:`tensor_stats` of an FP32 tensor by masked copies (for one that holds inf or
    NaN)."""
    finite = torch.isfinite(t)
    nonfinite = int((~finite).sum())
    mags = t[finite].abs()
    nonzero = mags[mags > 0]
    if not mags.numel():
        return TensorStats(None, None, 0, 0, nonfinite)
    return TensorStats(float(mags.max()), float(mags.min()), nonzero.numel(),
                       int((nonzero < tiny).sum()), nonfinite)


def _count(flags: torch.Tensor) -> int:
    """How many of ``flags`` (FP32 zeros and ones) are 1: summed in FP32 (faster on CPU than
    a bool comparison and ``count_nonzero``), exact while every partial sum is an integer
    below 2**24; in FP64 past that."""
    return int(flags.sum() if flags.numel() < 1 << 24 else flags.sum(dtype=torch.float64))


def _piece_stats(t: torch.Tensor, tiny: float, scratch: Scratch) -> TensorStats:
    """:func:`tensor_stats` of one non-empty FP32 tensor, its temporaries in ``scratch``."""
    numel = t.numel()
    mags = torch.abs(t, out=scratch.like(t, "mags"))
    smallest, largest = (float(v) for v in torch.aminmax(mags))
    if not math.isfinite(largest):  # inf, or NaN (aminmax propagates it)
        return _masked_stats(t, tiny)
    zeros = below = 0
    if smallest < tiny:  # zeros and subnormals: |x| < tiny, less the zeros
        flags = scratch.like(t, "flags")
        if smallest == 0:
            zeros = _count(torch.eq(mags, 0, out=flags))
        below = _count(torch.lt(mags, tiny, out=flags))
    return TensorStats(largest, smallest, numel - zeros, below - zeros, 0)


def _flat(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s values as one flat view, in memory order (a transpose's too: the statistics
    do not depend on the order of the values); None where they are not one dense run."""
    if not t.is_contiguous():
        order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
        t = t.permute(order)
        if not t.is_contiguous():
            return None
    return t.view(-1)


def tensor_stats(t: torch.Tensor, tiny: float, scratch: Optional[Scratch] = None
                 ) -> TensorStats:
    """The range statistics of one floating tensor's values (as FP32): the largest and the
    smallest finite magnitude, the count of finite non-zero values, how many of those are
    below ``tiny`` and the count of non-finite values.

    The same numbers as masking (``mags = t[isfinite(t)].abs()``, then
    ``mags[mags > 0]``) without its copies of the tensor: a flat view of the values is
    reduced :data:`CHUNK` elements at a time. A piece's magnitudes go into a reused buffer;
    their ``aminmax`` gives the smallest and the largest and, since it propagates NaN and
    keeps inf, tells whether all of them are finite (else that piece is masked); the counts
    of zeros and of magnitudes below ``tiny`` are sums of comparisons written as 0 / 1 into
    a second reused buffer (:func:`_count`; each skipped where the smallest magnitude
    already tells it). Maxima, minima and integer counts do not depend on the order they
    are reduced in, so the results equal the masked ones exactly.

    Args:
        t: a floating tensor (FP16 / BF16 / FP64 values are taken as ``t.float()`` holds
            them, as the masked computation does).
        tiny: the low dtype's smallest normal (``torch.finfo(dtype).tiny``).
        scratch: buffers reused from call to call; None: fresh ones.

    Returns:
        The tensor's :class:`TensorStats`.
    """
    t = t.detach().float()
    if not t.numel():
        return TensorStats(None, None, 0, 0, 0)
    scratch = Scratch() if scratch is None else scratch
    flat = _flat(t)
    parts = [_piece_stats(p, tiny, scratch)
             for p in (flat.split(CHUNK) if flat is not None else (t,))]
    seen = [p for p in parts if p.max_abs is not None]
    return TensorStats(max((p.max_abs for p in seen), default=None),
                       min((p.min_abs for p in seen), default=None),
                       sum(p.nonzero for p in parts), sum(p.small for p in parts),
                       sum(p.nonfinite for p in parts))


class _Recorder(GraphRun):
    def __init__(self, gm: fx.GraphModule, tiny: float,
                 inner: Optional[Dict[str, Tuple[float, str]]] = None,
                 smallest: Optional[Dict[str, float]] = None,
                 spread: Optional[Dict[str, Spread]] = None) -> None:
        super().__init__(gm)
        self.tiny = tiny
        self.acc: Dict[str, list] = {}
        self.inner = inner  # node -> (largest inner value, its name), when measured
        self.smallest = smallest  # node -> smallest magnitude of its output, when measured
        self.spread = spread  # LayerNorm node -> its flattest input row, when measured
        self.current: Optional[fx.Node] = None  # the node running (named when it fails)
        self.scratch = Scratch()  # the statistics' temporaries, reused node after node

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> Tuple[tuple, Dict[str, Any]]:
        """fx's, with the FP32 model's own values where the graph holds others (a dtype
        read at run time that follows autocast's run): the ranges are the FP32 model's."""
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return fp32_values(n, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        result = super().run_node(n)
        if self.inner is not None and n.op in ops.OP_NODES:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            peak = inner_peak(n, self.module, args, kwargs)
            if peak is not None and math.isfinite(peak[0]):
                old = self.inner.get(n.name)
                if old is None or peak[0] > old[0]:
                    self.inner[n.name] = peak
            if self.spread is not None:
                flat = row_spread(n, self.module, args, kwargs)
                if flat is not None and (n.name not in self.spread
                                         or flat[0] < self.spread[n.name][0]):
                    self.spread[n.name] = flat
        leaves, _ = tree_flatten(result)
        floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if floats and n.op != "output":
            acc = self.acc.setdefault(n.name, [0.0, 0, 0, 0])  # max, small, nonzero, nonfinite
            for t in floats:
                s = tensor_stats(t, self.tiny, self.scratch)
                acc[3] += s.nonfinite
                if s.max_abs is not None:
                    acc[0] = max(acc[0], s.max_abs)
                    if self.smallest is not None:
                        low = s.min_abs
                        self.smallest[n.name] = min(self.smallest.get(n.name, low), low)
                acc[2] += s.nonzero
                acc[1] += s.small
        return result


def _shapes(values: Any) -> str:
    """``(2, 8), 'abc'``: the shapes of a batch's tensors, other values by repr."""
    return ", ".join(str(tuple(v.shape)) if isinstance(v, torch.Tensor) else repr(v)[:30]
                     for v in values)


_FIX = ("make every batch a tuple of the model's positional inputs with the shapes and "
        "types of example_inputs")


def _run_batch(recorder: _Recorder, gm: fx.GraphModule, batch: tuple, count: int,
               example: Optional[tuple]) -> None:
    """One calibration batch through the graph; a batch that does not fit the model is a
    CalibrationDataError naming the batch, the node that failed and the example's shapes."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    like = f"; the example inputs are ({_shapes(example)})" if example is not None else ""
    if len(batch) > len(places):
        raise CalibrationDataError(
            f"calibration batch {count} has {len(batch)} inputs ({_shapes(batch)}), the "
            f"model's graph takes {len(places)}{like}\n  what to do: {_FIX}")
    recorder.current = None
    try:
        recorder.run(*batch)
    except Exception as err:  # noqa: BLE001 - the user's batch, reported with its node
        node = recorder.current
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        where = f" at node {node.name!r}" if node is not None else ""
        if node is not None and is_input_guard(node):
            raise CalibrationDataError(
                f"calibration batch {count} ({_shapes(batch)}) does not fit the exported "
                f"graph's inputs: torch.export's shape check says {first}{like}\n  what to "
                f"do: {_FIX}, or give torch.export dynamic_shapes= for a dimension that "
                "varies") from err
        raise node_error(
            CalibrationDataError, node, f"calibration batch {count} ({_shapes(batch)}) fails "
            f"in the FP32 model{where}: {type(err).__name__}: {first}{like}", _FIX) from err


def _as_fp32(value: Any) -> Any:
    """A batch's FP16 / BF16 tensor as the FP32 model holds it: a block planned on a call
    gets its input in the dtype the block before it computes in (autocast's, for a
    deployment plan FP16), where the FP32 model, whose ranges these are, has it in FP32
    (the same values)."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def collect_ranges(gm: fx.GraphModule, batches: Iterable[Any], dtype: torch.dtype,
                   example: Optional[tuple] = None,
                   inner: Optional[Dict[str, Tuple[float, str]]] = None,
                   smallest: Optional[Dict[str, float]] = None,
                   spread: Optional[Dict[str, Spread]] = None) -> Dict[str, RangeStats]:
    """Run the FP32 graph on calibration batches and record each node's ranges; a batch
    that does not fit, or no batch at all, is a :class:`CalibrationDataError`. ``inner``: a
    dict filled with the largest number each node computes inside (see
    :mod:`fxamp.passes.inner_values`), when given; ``smallest``: one filled with the
    smallest magnitude of each node's output (a variance's smallest value); ``spread``: one
    filled with each LayerNorm's flattest input row (measured with ``inner``:
    :func:`fxamp.passes.inner_values.row_spread`)."""
    recorder = _Recorder(gm, torch.finfo(dtype).tiny, inner, smallest, spread)
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    count = 0
    with torch.no_grad(), reparametrize_module(gm, buffers, strict=False):
        for batch in track(batches, "calibration", unit="batch"):
            batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
            batch = tree_map(_as_fp32, batch)
            count += 1
            _run_batch(recorder, gm, batch, count, example)
            log.info("calibration batch %d done", count)
    if count == 0:
        raise CalibrationDataError(
            "calibration_data gave no batches (an empty list, or an iterator or generator "
            f"already used up); it takes {CALIBRATION_FORMS}\n  what to do: pass at least one "
            "batch, e.g. calibration_data=[(x,)], a fresh iterator, or leave it out")
    # rounded as the plan file writes them, so a plan's text round-trips exactly
    return {name: RangeStats(float(f"{a[0]:.6g}"), float(f"{a[1] / a[2] if a[2] else 0.0:.4f}"),
                             a[3])
            for name, a in recorder.acc.items()}


def _inputs_max(node: fx.Node, stats: Dict[str, RangeStats]) -> float:
    """The largest magnitude among the node's inputs, an attention mask's
    (``passes/mask_fill.py``) not counted: its fill only has to make exp give 0."""
    values = [stats[a.name].max_abs for a in node.all_input_nodes if a.name in stats
              and not (a.meta.get(MASK_PATH) and node.meta.get(MASK_PATH))]
    return max(values, default=0.0)


class RangesRule(DecisionRule):
    """Keep in FP32 the nodes whose values pass the low dtype's range on calibration data.
    The statistics: ``ctx.ranges`` if set (given, or collected by an earlier sweep), else
    collected once from ``ctx.calibration`` (batches of placeholder values)."""

    name = Rule.RANGES

    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        super().__init__(gm, ctx)
        self.deploy = is_deploy(self.policy.target)
        measure(gm, ctx)
        self.stats = ctx.ranges or {}
        self.inner = ctx.inner or {}
        self.low = self.policy.compute
        self.margin = DEPLOY_MARGIN if self.deploy else MARGIN
        self.limit = torch.finfo(self.low).max / self.margin
        more = isinstance(ctx.calibration, list) and len(ctx.calibration) > 1
        self.seen = ("calibration data" if not self.deploy else
                     "the example inputs and calibration data" if more else "the example inputs")

    def applies(self, node: fx.Node) -> bool:
        return (ir.precision(node) is not None
                and (node.name in self.stats or node.name in self.inner)
                and node.op not in ("placeholder", "get_attr"))

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        plan, low = ir.precision(node), self.low
        s = self.stats.get(node.name, RangeStats(0.0, 0.0, 0))
        out_max, in_max = s.max_abs, _inputs_max(node, self.stats)
        if node.meta.get(MASK_PATH):  # a mask's fill, or a value masked by it
            out_max = 0.0
        if s.underflow > 0.5:
            log.warning("%s: %.0f%% of its non-zero values are below %s's smallest normal",
                        node.name, 100 * s.underflow, dtype_name(low))
        if plan.dtype != low and plan.inputs != low:
            return {}
        if out_max > self.limit or in_max > self.limit:
            which = "its output" if out_max > self.limit else "an input"
            value = out_max if out_max > self.limit else in_max
            return {node: self.verdict(
                torch.float32, f"{which} reaches {value:.3g} on {self.seen}, past "
                f"{dtype_name(low)}'s max {torch.finfo(low).max:.6g} / {self.margin:g}")}
        weight = _params_max(self.gm, node) if self.deploy else 0.0
        if weight > self.limit:
            return {node: self.verdict(
                torch.float32, f"a weight reaches {weight:.3g}, past {dtype_name(low)}'s max "
                f"{torch.finfo(low).max:.6g} / {self.margin:g}")}
        peak = self.inner.get(node.name)
        if peak is not None and peak[0] > torch.finfo(low).max:
            return {node: self.verdict(
                torch.float32, f"{peak[1]} reaches {peak[0]:.3g} on {self.seen}, past "
                f"{dtype_name(low)}'s max {torch.finfo(low).max:.6g}")}
        return {}


def measure(gm: fx.GraphModule, ctx: PassContext) -> None:
    """The statistics the range-based rules read, collected once per rewrite: ``ctx.ranges``
    (given, or from ``ctx.calibration``); for a deployment target also ``ctx.inner`` (the
    numbers each node computes inside) and, where batches were run, ``ctx.smallest`` (the
    smallest magnitude of each node's output) and ``ctx.spread`` (each LayerNorm's flattest
    input row)."""
    deploy = is_deploy(ctx.policy.target)
    if ctx.ranges is None:
        data = ctx.calibration
        inner: Optional[Dict[str, Tuple[float, str]]] = {} if deploy else None
        smallest: Optional[Dict[str, float]] = {} if deploy else None
        spread: Optional[Dict[str, Spread]] = {} if deploy else None
        ctx.ranges = ({} if data is None else dict(data) if isinstance(data, dict)
                      else collect_ranges(gm, data, ctx.policy.compute,
                                          tuple(ctx.inputs) if ctx.inputs else None,
                                          inner, smallest, spread))
        if inner is not None and not isinstance(data, dict) and data is not None:
            ctx.inner, ctx.smallest, ctx.spread = inner, smallest, spread
    if deploy and ctx.inner is None:
        ctx.inner, ctx.smallest, ctx.spread = _example_inner(gm, ctx, ctx.policy.compute)


def _example_inner(gm: fx.GraphModule, ctx: PassContext, dtype: torch.dtype
                   ) -> Tuple[Dict[str, Tuple[float, str]], Optional[Dict[str, float]],
                              Optional[Dict[str, Spread]]]:
    """The inner values, smallest magnitudes and LayerNorm row spreads of a deployment plan
    given its ranges (a plan's ``@range`` lines): measured on the example inputs when they
    are real tensors, else none."""
    inputs = tuple(ctx.inputs or ())
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    if not inputs or any(t.device.type == "meta" or type(t) is not torch.Tensor
                         for t in leaves):
        return {}, None, None
    inner: Dict[str, Tuple[float, str]] = {}
    smallest: Dict[str, float] = {}
    spread: Dict[str, Spread] = {}
    try:
        collect_ranges(gm, [inputs], dtype, inputs, inner, smallest, spread)
    except Exception as err:  # noqa: BLE001 - the ranges given are the calibration
        log.info("inner values not measured on the example inputs: %s", err)
        return {}, None, None
    return inner, smallest, spread


def _params_max(gm: fx.GraphModule, node: fx.Node) -> float:
    """The largest magnitude among a called module's own floating parameters and buffers."""
    if node.op != "call_module":
        return 0.0
    module = gm.get_submodule(str(node.target))
    values = [t.detach().abs().max() for t in list(module.parameters()) + list(module.buffers())
              if t.is_floating_point() and t.numel() and t.device.type != "meta"]
    return float(max(values)) if values else 0.0


#: the ranges pass: ``(gm, ctx) -> PassResult``
keep_in_range = rule_pass(RangesRule)
