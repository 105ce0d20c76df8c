"""The pass contract and the pass manager (after torch.fx's ``passes/infra``).

A pass is ``(gm, ctx) -> PassResult``: it gets the graph module and the rewrite's
:class:`PassContext`, reads and writes the IR (``fxamp.ir``), and says whether it changed
anything. The pipeline declares its passes as a list of :class:`Step`; :class:`PassManager`
runs them in order, skips the steps whose condition is false, checks the graph after each
step that changed it, and re-annotates after each decision step that changed a decision.
:func:`fixpoint` runs a group of decision steps again until none changes anything.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch.fx as fx

from ..overrides import Scope
from ..plan import Plan, RangeStats
from ..policy import Policy
from ..rules import DecisionRule
from . import PassResult

log = logging.getLogger(__name__)

#: a decision group reaching no fixpoint after this many sweeps is an internal error
MAX_SWEEPS = 8


class Restorable(Protocol):
    """A snapshot of the model's state (``fxamp.frontends.state.ModelState``), put back
    after each run of the model's code."""

    def restore(self) -> Any:
        """Put the model's state back as it was when the snapshot was taken."""
        ...


@dataclasses.dataclass
class PassContext:
    """What a rewrite's passes share besides the graph.

    policy: the frozen Policy. inputs: the graph's placeholder values (real or fake).
    calibration: calibration batches (placeholder tuples), a dict of RangeStats or None.
    ranges: the range statistics the ranges step collected (or was given).
    inner: for a deployment target, the largest number each node computes inside (a norm's
    sum of squares, a softmax's sum, a matmul's dot products) on the calibration inputs, and
    its name (``passes/inner_values.py``).
    smallest: for a deployment target whose calibration batches were run, the smallest
    magnitude of each node's output (``passes/norm_eps.py`` reads a variance's).
    spread: measured with ``smallest``, how flat each LayerNorm's input rows are
    (``passes/inner_values.row_spread``; ``passes/norm_eps.py`` reads it).
    annotate: the pass list's annotate step (set by the PassManager from the step marked
    ``annotates``; the decision steps re-run it after a change).
    session: the annotate step's fake-tensor session (one per rewrite).
    state: the model's state snapshot, restored after each run of its code (annotate's).
    scope: the rewrite's override record (which overrides matched; ``fxamp.overrides``).
    nested: the plans of submodules rewritten on their own, by path.
    rules: the user's decision rules (``RewriteConfig.rules``), run by the ``user_rules``
    step.
    """

    policy: Policy
    inputs: tuple = ()
    calibration: Optional[Iterable[Any]] = None
    ranges: Optional[Dict[str, RangeStats]] = None
    inner: Optional[Dict[str, Tuple[float, str]]] = None
    smallest: Optional[Dict[str, float]] = None
    spread: Optional[Dict[str, Tuple[float, float, float, float]]] = None
    annotate: Optional[Callable[[fx.GraphModule, "PassContext"], PassResult]] = None
    session: Any = None  # (annotate.FakeSession: annotate imports this module)
    state: Optional[Restorable] = None
    scope: Optional[Scope] = None
    nested: Dict[str, Plan] = dataclasses.field(default_factory=dict)
    rules: Tuple[DecisionRule, ...] = ()
    log: List[str] = dataclasses.field(default_factory=list)  # "step: modified" lines


Pass = Callable[[fx.GraphModule, PassContext], PassResult]


@dataclasses.dataclass(frozen=True)
class Step:
    """One entry of the pass list. ``when``: run only if it returns True for the context.
    ``decides``: a decision step: when it changes a decision, annotate runs again."""

    name: str
    run: Pass
    when: Callable[[PassContext], bool] = lambda ctx: True
    decides: bool = False
    rewrites: bool = False  # changes the graph in place: recompiled after a change
    annotates: bool = False  # the annotate step: decision steps re-run it after a change


def check_graph(gm: fx.GraphModule) -> None:
    """The check run between passes: the graph is well formed (``Graph.lint``)."""
    gm.graph.lint()


def _run_step(step: Step, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = step.run(gm, ctx)
    ctx.log.append(f"{step.name}: {'modified' if result.modified else 'unchanged'}")
    if result.modified:
        log.debug("%s changed the graph or its decisions", step.name)
        check_graph(result.graph_module)
        if step.rewrites:
            result.graph_module.recompile()
        if step.decides and ctx.annotate is not None:
            ctx.annotate(result.graph_module, ctx)
    return result


def fixpoint(name: str, steps: Sequence[Step]) -> Step:
    """A step running ``steps`` (decision steps) in order, again and again until a sweep
    changes nothing."""
    def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        modified = False
        for _ in range(MAX_SWEEPS):
            swept = False
            for step in steps:
                if step.when(ctx):
                    result = _run_step(step, gm, ctx)
                    gm = result.graph_module
                    swept |= result.modified
            modified |= swept
            if not swept:
                return PassResult(gm, modified)
        raise RuntimeError(f"fxamp internal error: the decision steps of {name!r} did not "
                           f"settle after {MAX_SWEEPS} sweeps ({', '.join(ctx.log[-5:])})")
    return Step(name, run)


class PassManager:
    """Runs a declared list of steps on a graph module."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = list(steps)

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        ctx.annotate = next((s.run for s in self.steps if s.annotates), ctx.annotate)
        modified = False
        for step in self.steps:
            if not step.when(ctx):
                continue
            result = _run_step(step, gm, ctx)
            gm = result.graph_module
            modified |= result.modified
        return PassResult(gm, modified)
