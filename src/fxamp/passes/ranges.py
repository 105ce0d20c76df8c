"""Ranges pass (rule "ranges"): value ranges seen on calibration batches.

``collect_ranges`` runs the FP32 source graph on real batches (no grad; buffers such as
BatchNorm's running statistics are cloned, so the model is unchanged) and records per node the
largest magnitude, the fraction of non-zero values below the low dtype's smallest normal, and
the count of non-finite values. ``keep_in_range`` keeps in FP32 every node whose output — or
one of whose floating inputs — would pass the low dtype's largest value with a safety margin:
the node that overflows and the nodes it feeds until the values are back in range. bf16 has
FP32's range, so for bf16 only real overflows count. Nodes whose values mostly underflow are
reported (logged), not changed.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable

import torch
import torch.fx as fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten

from ..plan import RangeStats
from ..policy import Policy, dtype_name
from ..progress import track
from . import PassResult
from .annotate import META, fix

log = logging.getLogger(__name__)

MARGIN = 2.0  # keep values below max / MARGIN in the low dtype


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, tiny: float) -> None:
        super().__init__(gm)
        self.tiny = tiny
        self.acc: Dict[str, list] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        leaves, _ = tree_flatten(result)
        floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if floats and n.op != "output":
            acc = self.acc.setdefault(n.name, [0.0, 0, 0, 0])  # max, small, nonzero, nonfinite
            for t in floats:
                t = t.detach().float()
                finite = torch.isfinite(t)
                acc[3] += int((~finite).sum())
                mags = t[finite].abs()
                if mags.numel():
                    acc[0] = max(acc[0], float(mags.max()))
                nonzero = mags[mags > 0]
                acc[2] += nonzero.numel()
                acc[1] += int((nonzero < self.tiny).sum())
        return result


def collect_ranges(gm: fx.GraphModule, batches: Iterable[Any],
                   dtype: torch.dtype) -> Dict[str, RangeStats]:
    """Run the FP32 graph on calibration batches and record each node's ranges."""
    recorder = _Recorder(gm, torch.finfo(dtype).tiny)
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    count = 0
    with torch.no_grad(), _reparametrize_module(gm, buffers, strict=False):
        for batch in track(batches, "calibration", unit="batch"):
            batch = batch if isinstance(batch, (tuple, list)) else (batch,)
            recorder.run(*batch)
            count += 1
            log.info("calibration batch %d done", count)
    if count == 0:
        raise ValueError("calibration_data yielded no batches")
    # rounded as the plan file writes them, so a plan's text round-trips exactly
    return {name: RangeStats(float(f"{a[0]:.6g}"), float(f"{a[1] / a[2] if a[2] else 0.0:.4f}"),
                             a[3])
            for name, a in recorder.acc.items()}


def _inputs_max(node: fx.Node, stats: Dict[str, RangeStats]) -> float:
    values = [stats[a.name].max_abs for a in node.all_input_nodes if a.name in stats]
    return max(values, default=0.0)


def keep_in_range(gm: fx.GraphModule, policy: Policy,
                  stats: Dict[str, RangeStats]) -> PassResult:
    """Keep in FP32 the nodes whose values pass the low dtype's range (reads the plan)."""
    low = policy.compute
    limit = torch.finfo(low).max / MARGIN
    changed = False
    for node in gm.graph.nodes:
        plan = node.meta.get(META)
        s = stats.get(node.name)
        if plan is None or s is None or node.op in ("placeholder", "get_attr"):
            continue
        out_max, in_max = s.max_abs, _inputs_max(node, stats)
        if s.underflow > 0.5:
            log.warning("%s: %.0f%% of its non-zero values are below %s's smallest normal",
                        node.name, 100 * s.underflow, dtype_name(low))
        if plan.dtype != low and plan.inputs != low:
            continue
        if out_max > limit or in_max > limit:
            which = "its output" if out_max > limit else "an input"
            value = out_max if out_max > limit else in_max
            changed |= fix(node, torch.float32, "ranges",
                           f"{which} reaches {value:.3g} on calibration data, past "
                           f"{dtype_name(low)}'s max {torch.finfo(low).max:.6g} / {MARGIN:g}")
    return PassResult(gm, modified=changed)
