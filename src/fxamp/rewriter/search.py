"""Tolerance search: a small set of FP32 nodes that makes the rewrite meet an error bound.

``search`` first rewrites with the plan as it is. If the outputs (or a user metric) miss the
tolerance against FP32, it scores every low-precision node by its *local* error — the node run
in the low dtype on the FP32 values of its inputs, compared with its FP32 output, in one pass
over the graph — flips the worst nodes to FP32 in doubling groups until the tolerance is met,
then bisects that group down and drops flips that are not needed. Flipped nodes carry
``rule="search"``; each is an ``fp32:NAME`` item of the result's policy (its plan header and
``fxamp.config_of``), so a saved search plan re-applies: ``amp_rewrite(model, x,
plan.policy)``.

``bisect_baseline`` is the anchor tools' method (Polygraphy ``debug precision``): bisect a
prefix, or a suffix, of the graph's low-precision nodes kept in FP32. Both report how many
model evaluations they used (one evaluation = one rewrite run over the data; the scoring
pass counts as one).

Both search flat rewrites of the FP32 model. A model rewritten in place (block mode too:
``rewriter/blocks.py``) is searched as its FP32 form, a shadow with its own forwards back
(``overlap.own_forwards``): the references are the FP32 model's outputs, the results share
its Parameters, and the model keeps its rewrite.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import (Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple,
                    Union)

import torch
import torch.fx as fx
import torch.nn as nn
from .._torch import reparametrize_module, tree_flatten, tree_map

from ..config import RewriteConfig
from ..errors import FxampError
from ..graph_run import GraphRun
from ..ir import Rule
from ..frontends import graph_inputs, trace_model
from ..policy import Policy, dtype_name
from ..progress import advance, shows, track
from ..runtime import eligible
from ..frontends.common import as_tuple
from ..result import result_of, set_result
from .inputs import check_model
from .overlap import fp32_form
from .pipeline import DEPRECATED_KEYWORDS, amp_rewrite, plan_of, read_config

log = logging.getLogger(__name__)

Metric = Callable[[List[Any], List[Any]], float]


def max_relative_error(outputs: List[Any], references: List[Any]) -> float:
    """max |out - ref| / max |ref| over all floating outputs of all batches."""
    worst = 0.0
    for out, ref in zip(outputs, references):
        outs, _ = tree_flatten(out)
        refs, _ = tree_flatten(ref)
        for o, r in zip(outs, refs):
            if isinstance(r, torch.Tensor) and r.is_floating_point():
                o, r = o.detach().float(), r.detach().float()
                if not torch.isfinite(o).all():
                    return float("inf")
                scale = r.abs().max().item() or 1.0
                worst = max(worst, (o - r).abs().max().item() / scale)
    return worst


@dataclass
class SearchResult:
    """What a search found: the rewritten model, the FP32 nodes it chose, what it cost.

    Attributes:
        graph_module: the model rewritten with the chosen nodes in FP32.
        fp32_nodes: the names of the nodes the search keeps in FP32, beyond the policy.
        evaluations: how many times the model was rewritten and run on the data (the
            scoring pass counts as one).
        error: the rewritten model's error against FP32 on the data (the metric's value).
        met: whether ``error`` is at most the ``rtol`` asked for.
        history: ``(number of FP32 nodes, error)`` of each evaluation, in order.
    """

    graph_module: fx.GraphModule
    fp32_nodes: List[str]
    evaluations: int
    error: float
    met: bool
    history: List[Tuple[int, float]] = field(default_factory=list)  # (n fp32 nodes, error)


class _Evaluator:
    def __init__(self, model: nn.Module, inputs: tuple, config: RewriteConfig,
                 batches: List[tuple], metric: Metric) -> None:
        self.model, self.inputs, self.config = model, inputs, config
        self.pol = config.policy
        self.batches, self.metric = batches, metric
        with torch.no_grad():
            kwargs = config.example_kwargs or {}
            self.references = [model(*b, **kwargs) for b in batches]
        self.count = 0
        self.history: List[Tuple[int, float]] = []

    def __call__(self, nodes: Sequence[str], rule: str = Rule.SEARCH,
                 reasons: Optional[Dict[str, str]] = None) -> Tuple[float, fx.GraphModule]:
        gm = _rewrite_with_fp32(self.model, self.inputs, self.config, nodes, rule,
                                reasons or {})
        kwargs = self.config.example_kwargs or {}
        with torch.no_grad():
            outputs = [gm(*b, **kwargs) for b in self.batches]
        self.count += 1
        error = self.metric(outputs, self.references)
        self.history.append((len(nodes), error))
        log.info("evaluation %d: %d fp32 nodes, error %.3g", self.count, len(nodes), error)
        advance(postfix=f"{len(nodes)} fp32 nodes, error {error:.3g}")
        return error, gm


def _rewrite_with_fp32(model: nn.Module, inputs: tuple, config: RewriteConfig,
                       nodes: Sequence[str], rule: str, reasons: Dict[str, str]
                       ) -> fx.GraphModule:
    """``amp_rewrite`` with ``config`` plus an ``fp32:NAME`` override per node of ``nodes``,
    those nodes' plan lines marked ``rule`` with their reason (as a healed Trainer's plan).

    The overrides are the search's decisions as the policy says them: the plan header, the
    stored config (``fxamp.config_of``) and so a saved plan's policy carry them, and
    ``amp_rewrite(model, x, plan.policy)`` plans the same dtypes."""
    gm = amp_rewrite(model, inputs, config=config.with_fp32(nodes))
    if not nodes:
        return gm
    plan, chosen = plan_of(gm), set(nodes)
    marked = {name: replace(p, rule=rule,
                            reason=reasons.get(name, "kept in fp32 to meet the tolerance"))
              if name in chosen else p for name, p in plan.nodes.items()}
    set_result(gm, result_of(gm).replace(plan=replace(plan, nodes=marked)))
    return gm


def _low_nodes(gm: fx.GraphModule, pol: Policy) -> List[str]:
    plan = plan_of(gm)
    return [name for name, p in plan.nodes.items()
            if p.dtype == pol.compute and p.rule not in (Rule.USER, Rule.RUNTIME)]


class _LocalError(GraphRun):
    """Runs the FP32 graph; for each candidate also runs it on low-precision inputs."""

    def __init__(self, gm: fx.GraphModule, candidates: Iterable[str], low: torch.dtype) -> None:
        super().__init__(gm)
        self.candidates, self.low = set(candidates), low
        self.scores: Dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name not in self.candidates or not isinstance(result, torch.Tensor):
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        to_low = lambda v: v.to(self.low) if eligible(v) else v  # noqa: E731
        args, kwargs = tree_map(to_low, (args, kwargs))
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            params = {k: to_low(p) for k, p in module.named_parameters()}
            low_out = torch.func.functional_call(module, params, args, kwargs, strict=False)
        else:
            low_out = getattr(self, n.op)(n.target, args, kwargs)
        if isinstance(low_out, torch.Tensor) and low_out.is_floating_point():
            ref = result.detach().float()
            err = (low_out.detach().float() - ref).abs()
            scale = ref.abs().max().item() or 1.0
            value = float("inf") if not torch.isfinite(err).all() else err.max().item() / scale
            self.scores[n.name] = max(self.scores.get(n.name, 0.0), value)
        return result


def local_errors(model: nn.Module, batches: List[tuple], candidates: Iterable[str],
                 low: torch.dtype, frontend: str = "auto",
                 kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """Each candidate node's relative error when it alone runs in ``low`` on FP32 inputs,
    on the graph of the front end ``frontend`` (the one the rewrite used: same node names).
    ``kwargs`` are the forward's keyword arguments, the same for every batch."""
    kwargs = dict(kwargs or {})
    traced = trace_model(model, tuple(batches[0]), kwargs, frontend)
    src = traced.graph_module
    scorer = _LocalError(src, candidates, low)
    buffers = {name: b.clone() for name, b in src.named_buffers()}
    with torch.no_grad(), reparametrize_module(src, buffers,
                                                                          strict=False):
        for batch in track(batches, "scoring nodes", unit="batch"):
            scorer.run(*graph_inputs(model, traced, tuple(batch), kwargs))
    return scorer.scores


#: the keywords ``search`` and ``bisect_baseline`` took before ``config`` held them
TOOL_KEYWORDS = ("dtype", "target", "policy", "frontend")


def tool_config(name: str, call: str, config: Union[None, str, Policy, RewriteConfig],
                deprecated: Dict[str, Any], taken: Sequence[str] = TOOL_KEYWORDS,
                stacklevel: int = 3) -> RewriteConfig:
    """The ``RewriteConfig`` of a tool's ``config``, read as ``amp_rewrite`` reads its own
    (``pipeline.read_config``: a ``RewriteConfig``, a ``Policy``, a policy text or None), or of
    the keywords the tool took before ``config`` held them (``taken``), made with
    ``RewriteConfig.make`` and warned as deprecated. Its target is not resolved yet
    (``RewriteConfig.for_model``).

    Args:
        name: the tool's name, for the messages (``"search"``).
        call: its arguments before the config, for the warning's new spelling
            (``"model, example_inputs, data"``).
        config: the ``config`` the tool was given.
        deprecated: the other keywords it was given (its ``**deprecated``).
        taken: the keywords the tool took before (each one of ``amp_rewrite``'s
            ``DEPRECATED_KEYWORDS``).
        stacklevel: the ``FutureWarning``'s, counted from here (the tool's caller: 3 for a
            tool that calls this itself; one more per decorator around it).

    Returns:
        The config.

    Raises:
        TypeError: a keyword the tool never took.
        FxampError: ``config`` together with deprecated keywords, or a ``config`` of
            another type.
    """
    return read_config(config, deprecated, name, call,
                       [key for key in taken if key in DEPRECATED_KEYWORDS], stacklevel + 1)


def _prepare(model: nn.Module, example_inputs: Any, data: Iterable[Any],
             metric: Optional[Metric], config: RewriteConfig) -> _Evaluator:
    check_model(model)
    config = config.for_model(model, (example_inputs, config.example_kwargs))
    batches = [as_tuple(b) for b in data]
    if not batches:
        raise FxampError("search needs at least one batch of data")
    return _Evaluator(model, as_tuple(example_inputs), config, batches,
                      metric or max_relative_error)


@shows("search", unit="eval")
def search(model: nn.Module, example_inputs: Any, data: Iterable[Any],
           config: Union[None, str, Policy, RewriteConfig] = None, *, rtol: float = 1e-2,
           metric: Optional[Metric] = None, **deprecated: Any) -> SearchResult:
    """Find a small set of FP32 nodes so the rewrite's error against FP32 is at most ``rtol``.

    Each low-precision node is scored by its error when it alone runs in low precision;
    groups of the worst ones (1, 2, 4... nodes) are kept in FP32 until the error meets
    ``rtol``, then the group is bisected to the smallest prefix that does. The scoring pass
    traces with the same front end as the rewrites.

    Args:
        model: the FP32 model (left unchanged), or a model rewritten in place (searched as
            its FP32 form; it keeps its rewrite).
        example_inputs: the forward's arguments to trace with (a tuple, or one tensor).
        data: the batches to measure the error on (each a tuple of the forward's
            arguments, or one tensor); the FP32 model's outputs on them are the reference.
        config: the rewrite the search starts from, as ``amp_rewrite``'s ``config``: a
            ``RewriteConfig`` (``RewriteConfig.make(dtype=..., target=..., policy=...,
            frontend=...)``, or ``fxamp.config_of(gm)`` of an earlier rewrite), a
            ``Policy``, or a policy's text form (``"compute=bf16,target=cpu"``, a recipe
            name); None: ``RewriteConfig.make()``, float16 for the device the model is on.
            Each rewrite of the search is this config with its FP32 nodes added.
        rtol: the largest error accepted.
        metric: ``metric(outputs, references) -> float`` (lists over the batches); by
            default the largest relative output error.
        **deprecated: the keywords the config holds that ``search`` took before
            (``dtype``, ``target``, ``policy``, ``frontend``), taken for one more release
            with a ``FutureWarning``: they build ``RewriteConfig.make(**deprecated)``.

    Returns:
        The ``SearchResult``; ``met`` is False (and a warning is logged) when even every
        low-precision node in FP32 leaves the error above ``rtol``.

    Raises:
        FxampError: ``data`` holds no batch, the model cannot be rewritten (the subclass
            says why, as ``amp_rewrite`` does), or ``config`` together with the
            (deprecated) keywords it holds.
        TypeError: a keyword ``search`` does not take.
    """
    config = tool_config("search", "model, example_inputs, data", config, deprecated,
                         stacklevel=4)  # (the caller of the progress bar's wrapper)
    with fp32_form(model) as fp32:
        evaluate = _prepare(fp32, example_inputs, data, metric, config)
        return _search(fp32, evaluate, rtol)


def _search(model: nn.Module, evaluate: _Evaluator, rtol: float) -> SearchResult:
    """:func:`search` on the FP32 model, its evaluator made."""
    error, gm = evaluate([])
    if error <= rtol:
        return SearchResult(gm, [], evaluate.count, error, True, evaluate.history)
    low = evaluate.pol.compute
    candidates = _low_nodes(gm, evaluate.pol)
    scores = local_errors(model, evaluate.batches, candidates, low,
                          evaluate.config.frontend, evaluate.config.example_kwargs)
    evaluate.count += 1  # the scoring pass
    order = sorted(candidates, key=lambda n: -scores.get(n, 0.0))

    def reasons(nodes: Sequence[str]) -> Dict[str, str]:
        return {n: f"kept in fp32 by fxamp.search: alone in {dtype_name(low)} it is off by "
                   f"{scores.get(n, 0.0):.2g} (relative); with it the outputs meet rtol={rtol:g}"
                for n in nodes}

    k, best = 1, None
    while True:  # doubling groups of the worst nodes
        k = min(k, len(order))
        error, gm = evaluate(order[:k], reasons=reasons(order[:k]))
        if error <= rtol or k == len(order):
            best = (k, error, gm)
            break
        k *= 2
    k, error, gm = best
    if error > rtol:
        log.warning("search: even %d fp32 nodes leave the error at %.3g > %g", k, error, rtol)
        return SearchResult(gm, order[:k], evaluate.count, error, False, evaluate.history)
    lo, hi = k // 2, k  # bisect the group: the smallest prefix that meets the tolerance
    while hi - lo > 1:
        mid = (lo + hi) // 2
        e, g = evaluate(order[:mid], reasons=reasons(order[:mid]))
        if e <= rtol:
            hi, error, gm = mid, e, g
        else:
            lo = mid
    chosen = order[:hi]
    for name in list(reversed(chosen))[:8]:  # drop flips that are not needed
        trial = [n for n in chosen if n != name]
        if not trial:
            break
        e, g = evaluate(trial, reasons=reasons(trial))
        if e <= rtol:
            chosen, error, gm = trial, e, g
    return SearchResult(gm, chosen, evaluate.count, error, True, evaluate.history)


@shows("bisection", unit="eval")
def bisect_baseline(model: nn.Module, example_inputs: Any, data: Iterable[Any],
                    config: Union[None, str, Policy, RewriteConfig] = None, *,
                    rtol: float = 1e-2, metric: Optional[Metric] = None,
                    **deprecated: Any) -> SearchResult:
    """Polygraphy-style baseline: bisect the shortest FP32 prefix, and the shortest FP32
    suffix, of the low-precision nodes in graph order; keep the smaller.

    Args:
        model: the FP32 model (left unchanged), or a model rewritten in place (searched as
            its FP32 form; it keeps its rewrite).
        example_inputs: the forward's arguments to trace with (a tuple, or one tensor).
        data: the batches to measure the error on (each a tuple of the forward's
            arguments, or one tensor).
        config: the rewrite to bisect, as ``amp_rewrite``'s ``config`` (a
            ``RewriteConfig``, a ``Policy``, a policy's text form, or None: see
            ``search``).
        rtol: the largest error accepted.
        metric: ``metric(outputs, references) -> float`` (lists over the batches); by
            default the largest relative output error.
        **deprecated: the keywords the config holds that ``bisect_baseline`` took before
            (``dtype``, ``target``, ``policy``, ``frontend``), taken for one more release
            with a ``FutureWarning``: they build ``RewriteConfig.make(**deprecated)``.

    Returns:
        The ``SearchResult`` (the plan marks its FP32 nodes ``rule="bisect"``); ``met`` is
        False when neither every prefix nor every suffix meets ``rtol``.

    Raises:
        FxampError: ``data`` holds no batch, the model cannot be rewritten, or ``config``
            together with the (deprecated) keywords it holds.
        TypeError: a keyword ``bisect_baseline`` does not take.
    """
    config = tool_config("bisect_baseline", "model, example_inputs, data", config, deprecated,
                         stacklevel=4)  # (the caller of the progress bar's wrapper)
    with fp32_form(model) as fp32:
        evaluate = _prepare(fp32, example_inputs, data, metric, config)
        return _bisect(evaluate, rtol)


def _bisect(evaluate: _Evaluator, rtol: float) -> SearchResult:
    """:func:`bisect_baseline`, its evaluator made."""
    error, gm = evaluate([], rule=Rule.BISECT)
    if error <= rtol:
        return SearchResult(gm, [], evaluate.count, error, True, evaluate.history)
    order = _low_nodes(gm, evaluate.pol)
    found: List[Tuple[List[str], float, fx.GraphModule]] = []
    for part in (lambda m: order[:m], lambda m: order[len(order) - m:]):
        e, g = evaluate(part(len(order)), rule=Rule.BISECT)
        if e > rtol:
            continue
        lo, hi, best = 0, len(order), (part(len(order)), e, g)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            e, g = evaluate(part(mid), rule=Rule.BISECT)
            if e <= rtol:
                hi, best = mid, (part(mid), e, g)
            else:
                lo = mid
        found.append(best)
    if not found:
        return SearchResult(gm, order, evaluate.count, error, False, evaluate.history)
    nodes, error, gm = min(found, key=lambda f: len(f[0]))
    return SearchResult(gm, nodes, evaluate.count, error, True, evaluate.history)
