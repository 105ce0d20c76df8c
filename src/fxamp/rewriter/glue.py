"""The glue: a model's own forward in block mode, planned as one region.

In block mode (:mod:`.blocks`) the model's own forward is the code between its regions:
embeddings, masks, a final norm, a head, a hand-written loss. It is traced by torch.fx with
each region kept as a module call (``RewriteConfig.regions``) and planned like any graph,
on the model's call, the same call that plans its blocks: autocast's dtypes, the numerics
rules (a loss in FP32, a hand-written softmax), plan lines. A region is called as a module
(its hooks run), with its inputs as the glue's plan gives them; its own plan casts inside
it (a region that runs under autocast, past its limit of graphs or as an eager root, enters
autocast itself), and every cast of its outputs (and of the items of a tuple it returns),
and of what the glue's ops that follow their inputs' dtypes make of them (an add, a
residual), is kept (``ir.NodeIR.region``, ``passes/casts.py``): their dtypes are the
region's plan's, known when it runs, so an FP32 output flows on as in the flat plan. The
composed plan's glue lines for those values give the dtypes they compute in, from the
regions' plans (``Glue.lines``), as the flat plan's lines do. A region with call hooks of
its own is called under ``torch.autocast`` (``runtime.region_call``), so its hooks compute
as they do around the model's forward run under autocast.

While the glue is planned, its regions run as their class's code on the shadow tree
(``Shadow.bare``): under ``torch.autocast`` where a node's dtypes are decided, as autocast
runs them. The blocks themselves are planned on their own first call, from their real
arguments, when the glue's graph calls them.

Each graph is kept for one training mode, call structure and set of floating input dtypes
(and, where fx could take the forward only with the call's Python scalars as constants, a
branch on a bool flag say, for their values, checked on entry); at most ``LIMIT`` graphs
are planned, then the glue runs under ``torch.autocast`` with one warning. Where torch.fx
does not take the forward (Hugging Face models' mask code branches on shapes), the glue
runs under ``torch.autocast`` from the first call on, and the plan header says why. A call
that fails while its graph is planned, or in that graph's first run, runs under autocast:
when that works, the failure was fxamp's, and the glue runs under autocast from then on
(one warning naming it); when it fails too, it is the model's own error, raised, and no
graph is kept.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .. import _torch, ir
from ..config import RewriteConfig
from ..errors import TraceError, shorten
from ..frontends.fx import trace
from ..ir import Rule
from ..ops import module_label
from ..plan import NodePrecision, Plan
from ..result import has_result, plan_of, result_of
from ..runtime import region_call
from ..structure import StructureChanged
from .inplace import LIMIT, MISSES, Planner, made_for, missed, variant_key

log = logging.getLogger(__name__)

#: the plan header's ``glue:`` when the glue has its own plan lines
TRACED = "the model's own forward, traced by torch.fx with the regions as calls: its lines"
#: the header's ``glue:`` when it runs under autocast (the reason follows)
UNDER_AUTOCAST = "the model's own forward under torch.autocast"
#: the header's ``glue:`` before the first call
NOT_YET = ("the model's own forward, planned on the first call (traced by torch.fx with the "
           "regions as calls, or under torch.autocast where fx does not take it)")


def mark_regions(gm: fx.GraphModule, regions: Iterable[str]) -> None:
    """Make each call of a region in ``gm`` a module call, run under ``torch.autocast``
    while the glue is planned, whose outputs' casts are all kept (see the module
    docstring).

    Args:
        gm: the glue's traced graph.
        regions: the regions' paths.
    """
    paths = set(regions)
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in paths:
            ir.set(node, region=True, fixed=ir.Decision(
                None, Rule.RUNTIME, "a region, called as a module and planned on its own "
                "on its first call", module_label(
                    gm.get_submodule(str(node.target))), runtime=True))
            todo = list(node.users)  # (the items of a tuple it returns: theirs too)
            while todo:
                user = todo.pop()
                if user.op == "call_function" and user.target is operator.getitem:
                    ir.set(user, region=True)
                    todo.extend(user.users)


#: ``Glue._plan`` behind ``torch.compiler.disable``, made with the first glue
_EAGER: List[Callable[..., Any]] = []


class Glue:
    """The glue's graphs, planned on the model's calls (see the module docstring).

    Args:
        model: the model in block mode.
        paths: its regions.
        config: the block mode's config (its target resolved on the first call).
        plan: what plans the model on a call (the pipeline's).
    """

    def __init__(self, model: nn.Module, paths: List[str], config: RewriteConfig,
                 plan: Planner) -> None:
        self.model = model
        self.paths = paths
        self.config = config
        self.plan = plan
        self.graphs: Dict[tuple, List[nn.Module]] = {}  # (by variant key, newest first)
        self.first: Optional[nn.Module] = None  # (the first graph: the plan's glue lines)
        self.off: Optional[str] = None  # why it runs under autocast (None: it does not)
        self.made: List[str] = []  # (each graph planned: what for and why; graphs_of)
        self.count = 0  # (graphs planned: at most LIMIT)
        self.overrides: list = []  # (the policy's overrides naming its modules, op labels)
        self.elsewhere: Tuple[Any, ...] = ()  # (those another region may match instead)
        self.why: Optional[str] = None  # (:meth:`traced`'s answer, once asked)
        self.lock = threading.RLock()
        if not _EAGER:  # (made before any compiled region reaches it: not while tracing)
            _EAGER.append(torch.compiler.disable(Glue._plan))

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("lock", None)
        state.update(graphs={}, first=None, made=[], count=0)  # (a copy plans anew)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    def traced(self) -> Optional[str]:
        """None when torch.fx traces the model's forward with the regions as calls (no
        call needed: every argument a symbol), else why not; traced once, when the blocks are
        installed (the default partition then makes the glue's modules regions) or an override
        names a module of the glue (before the model's forward is block mode's)."""
        if self.why is None:
            try:
                with _torch.tracing():
                    trace(self.model, self.paths)
                self.why = ""
            except TraceError as err:
                self.why = "torch.fx cannot trace it: " + shorten(
                    (str(err).splitlines() or [""])[0], 200)
        return self.why or None

    def reset(self) -> None:
        """Forget the graphs (a region was replaced: they call the old one)."""
        with self.lock:
            self.graphs, self.first, self.count = {}, None, 0

    def __call__(self, args: tuple, kwargs: Dict[str, Any],
                 autocast: Callable[[tuple, Dict[str, Any]], Any]) -> Any:
        """The model's forward on this call: its graph for the call, or ``autocast(args, kwargs)``.

        Args:
            args: the call's positional arguments.
            kwargs: its keyword arguments.
            autocast: runs the forward on a call under ``torch.autocast``.
        """
        if self.off is not None:
            return autocast(args, kwargs)
        key = variant_key(self.model, args, kwargs)
        why = miss = None
        tried = self.graphs.get(key, [])
        for gm in tried:
            try:
                return gm(*args, **kwargs)
            except StructureChanged as err:  # (the model changed: every graph is stale)
                if not err.replan:
                    raise
                self.reset()
                why = str(err)
                break
            except MISSES as err:  # (a Python value the graph holds, say: the next one)
                if not missed(err, gm):
                    raise
                miss = shorten(str(err).split("\n", 1)[0], 160)
        gm = self._planned(key, args, kwargs, why, miss, tried)
        if not isinstance(gm, nn.Module):
            return self._fallback(autocast, args, kwargs, gm)
        try:
            return gm(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - its first call: autocast's tells whose
            self._forget(key, gm)
            return self._fallback(autocast, args, kwargs, f"{type(err).__name__}: " + shorten(
                (str(err).splitlines() or [""])[0], 200))

    def _forget(self, key: tuple, gm: nn.Module) -> None:
        """Drop ``gm``, whose first call failed (a call that fails keeps no plan)."""
        with self.lock:
            self.graphs = {**self.graphs, key: [g for g in self.graphs.get(key, [])
                                                if g is not gm]}
            if self.first is gm:
                self.first = None

    def _planned(self, key: tuple, args: tuple, kwargs: Dict[str, Any], why: Optional[str],
                 miss: Optional[str], tried: List[nn.Module]) -> Union[nn.Module, str, None]:
        """A graph for ``key`` planned on this call (``why``: the model changed; ``miss``:
        what the graphs ``tried`` for ``key`` refused), or one another thread planned for
        it meanwhile; else None (the glue runs under autocast) or why planning failed."""
        if torch.compiler.is_compiling():  # (planned eagerly, outside a compiled region)
            return _EAGER[0](self, key, args, kwargs, why, miss, tried)
        return self._plan(key, args, kwargs, why, miss, tried)

    def _plan(self, key: tuple, args: tuple, kwargs: Dict[str, Any], why: Optional[str],
              miss: Optional[str], tried: List[nn.Module]) -> Union[nn.Module, str, None]:
        with self.lock:
            if self.off is not None:
                return None
            if why is None and self.graphs.get(key, tried) is not tried:
                return self.graphs[key][0]  # (another thread's, planned meanwhile)
            if self.count >= LIMIT:
                self._give_up(f"{LIMIT} graphs were planned for its calls (the limit); it "
                              "runs under torch.autocast from now on")
                log.warning("%s: the glue (its own forward between the blocks): %s",
                            type(self.model).__name__, self.off)
                return None
            config = self.config.for_model(self.model, (args, kwargs))
            config = config.replace(  # (its own overrides: those naming its modules)
                frontend="fx", regions=tuple(self.paths), elsewhere=tuple(self.elsewhere),
                policy=dataclasses.replace(config.policy, overrides=tuple(self.overrides)))
            try:
                gm = self.plan(self.model, args, kwargs, config, why)
            except TraceError as err:
                self._give_up("torch.fx cannot trace it: " + shorten(
                    (str(err).splitlines() or [""])[0], 200))
                log.info("%s: the glue runs under torch.autocast: %s",
                         type(self.model).__name__, self.off)
                return None
            except Exception as err:  # noqa: BLE001 - autocast's run tells whose it is
                return f"{type(err).__name__}: " + shorten(
                    (str(err).splitlines() or [""])[0], 200)
            structure = result_of(gm).structure
            if structure is not None:  # (the model computes with it: a change re-plans)
                structure.inplace = True
                structure.take()
            self.count += 1
            known = self.graphs.get(key, [])
            self.graphs = {**self.graphs, key: [gm, *known]}
            self.made.append(f"{made_for(key)}: " + (why or miss or (
                                 "the first call" if self.first is None else
                                 "a mode, call structure or input dtypes no graph was planned "
                                 "for")))
            if self.first is None:
                self.first = gm
            return gm

    def _give_up(self, why: str) -> None:
        """The glue runs under torch.autocast from now on, for ``why``."""
        self.off = why
        self.made.append(f"runs under torch.autocast: {why}")

    def _fallback(self, autocast: Callable[[tuple, Dict[str, Any]], Any], args: tuple,
                  kwargs: Dict[str, Any], failed: Optional[str]) -> Any:
        """This call under autocast; a planning failure (``failed``) that autocast does
        not share makes the glue run under autocast from now on."""
        out = autocast(args, kwargs)  # (raises: the model's own error; nothing is kept)
        if failed is not None and self.off is None:
            self._give_up(f"planning it failed ({failed})")
            log.warning("%s: the glue (its own forward between the blocks) cannot be "
                        "planned, so it runs under torch.autocast: %s",
                        type(self.model).__name__, failed)
        return out

    def header(self) -> str:
        """The plan header's ``glue:`` value."""
        if self.first is not None and has_result(self.first):
            return TRACED
        if self.off is not None:
            return f"{UNDER_AUTOCAST} ({self.off})"
        return NOT_YET

    def lines(self, blocks: Dict[str, Dict[str, NodePrecision]],
              outputs: Optional[Dict[str, Any]] = None) -> Dict[str, NodePrecision]:
        """The composed plan's lines: the glue's, each region's call replaced by its lines
        in ``blocks`` (by path; the regions the glue does not call follow, in order). A
        glue line for a value that ops following their inputs make of a region's outputs
        gives the dtype it computes in (:func:`_from_regions`), not autocast's.

        Args:
            blocks: each region's lines (its own line first), by path.
            outputs: each planned region's output dtypes (:func:`output_dtypes`), by path.
        """
        nodes: Dict[str, NodePrecision] = {}
        plan: Optional[Plan] = (plan_of(self.first) if self.first is not None
                                and has_result(self.first) else None)
        computed = (_from_regions(self.first.graph, plan.nodes, outputs)
                    if plan is not None and outputs else {})
        for name, line in (plan.nodes.items() if plan is not None else ()):
            if line.rule == Rule.RUNTIME and line.module in blocks:
                nodes.update(blocks.pop(line.module))
            elif name in computed:
                nodes[name] = dataclasses.replace(line, dtype=computed[name])
            else:
                nodes[name] = line
        for lines in blocks.values():
            nodes.update(lines)
        return nodes


def output_dtypes(gm: nn.Module) -> Any:
    """The dtypes of a region's outputs as its graph ``gm`` gives them, in the output's
    structure (a tuple of two tensors: a tuple of two dtypes); None for an output that is
    not a tensor the plan has a line for, and for a region that has no graph (an eager
    block: the glue's lines keep autocast's dtypes there).

    Args:
        gm: the region's rewritten graph (its result holds its plan).
    """
    if not isinstance(gm, fx.GraphModule):  # (an eager block has no graph: not known)
        return None
    lines = plan_of(gm).nodes
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    return None if out is None else fx.node.map_arg(out.args[0],
                                                    lambda n: _line_dtype(n, lines))


def _line_dtype(node: fx.Node, lines: Dict[str, NodePrecision]) -> Optional[torch.dtype]:
    """The dtype of ``node`` of a rewritten graph: its plan line's, or a cast's target."""
    cast = ir.cast_dtype(node)
    if cast is not None:
        return cast
    line = lines.get(node.name)
    return line.dtype if line is not None else None


def _from_regions(graph: fx.Graph, lines: Dict[str, NodePrecision],
                  outputs: Dict[str, Any]) -> Dict[str, torch.dtype]:
    """The glue's lines whose dtype its regions' plans change: each region call's items
    take the dtypes its plan gives them (``outputs``), and an op that follows its inputs'
    dtypes (no ``inputs`` dtype of its own) computes in the promotion of its floating
    inputs' (a residual add of an FP32 block output computes in FP32, as the flat plan's
    does). Line name -> the dtype it computes in, where it differs from the line's.

    Args:
        graph: the glue's rewritten graph.
        lines: the glue's plan lines.
        outputs: each region's output dtypes (:func:`output_dtypes`), by path.
    """
    known: Dict[fx.Node, Any] = {}
    changed: Dict[str, torch.dtype] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is region_call and node.args \
                and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
            if str(node.args[0].target) in outputs:
                known[node] = outputs[str(node.args[0].target)]
            continue
        if node.op == "call_function" and node.target is operator.getitem \
                and node.args[0] in known:
            items, index = known[node.args[0]], node.args[1]
            if isinstance(items, (tuple, list)) and isinstance(index, int) \
                    and -len(items) <= index < len(items):
                known[node] = items[index]
        else:
            line = lines.get(node.name)
            if line is None or line.inputs is not None or not line.dtype.is_floating_point \
                    or not any(n in known for n in node.all_input_nodes):
                continue
            floats = [known[n] if n in known else _line_dtype(n, lines)
                      for n in node.all_input_nodes]
            floats = [d for d in floats if isinstance(d, torch.dtype) and d.is_floating_point]
            if not floats:
                continue
            known[node] = functools.reduce(torch.promote_types, floats)
        line = lines.get(node.name)
        if node in known and line is not None and isinstance(known[node], torch.dtype) \
                and known[node] != line.dtype:
            changed[node.name] = known[node]
    return changed

