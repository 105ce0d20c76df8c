"""Front ends: how a model becomes something the passes can read, behind one protocol.

Every front end is an object with a ``name`` and ``capture(model, request)`` (see
:mod:`.base`); :data:`REGISTRY` holds them by name and :func:`capture_model` tries them in
the order ``config.FRONTEND_ORDER`` gives for the ``frontend=`` asked:

- ``fx`` (:mod:`.fx`): ``torch.fx`` symbolic tracing, torch-function level;
- ``export`` (:mod:`.aten`): ``torch.export`` (non-strict), ATen level, needs example inputs;
- ``fx+runtime`` (:mod:`.fx`, a fallback, ``auto`` only): fx with the submodules neither
  takes kept as calls;
- ``eager`` (:mod:`.eager`, a fallback, ``auto`` only): the model's own forward stays
  Python; its capture is :class:`.base.Children` (``kind == "children"``), which tells the
  layer above (the rewriter) to rewrite the children on their own and assemble them with
  :func:`.eager.eager_root`.

The graph front ends (``kind == "graph"``) also say how their graph is called
(:class:`.base.GraphFrontend`): :func:`graph_frontend` gives the one that took a graph.
What they share: train/eval alignment (:mod:`.modes`), training flags, the one-mode
warnings and nested plans (:mod:`.common`). This package imports only the layers below it
(core modules and ``passes``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .. import _torch
from ..config import FRONTEND_ORDER, FRONTENDS
from ..errors import TraceError
from .aten import AtenFrontend
from .dtype_reads import Settled
from .base import STATIC_SHAPES, Capture, Children, Frontend, GraphFrontend, Request, Traced
from ..graph_run import own_copies
from .eager import EagerFrontend
from .fx import MAX_RUNTIME_LEAVES, FxFrontend, PartialFrontend
from .model_checks import check_example_device, check_not_quantized
from .state import ModelState

FX = FxFrontend()
ATEN = AtenFrontend()
PARTIAL = PartialFrontend()
EAGER = EagerFrontend()

#: every front end, by the name the plan header records
REGISTRY: Dict[str, Frontend] = {fe.name: fe for fe in (FX, ATEN, PARTIAL, EAGER)}
assert all(name in REGISTRY for names in FRONTEND_ORDER.values() for name in names)


def capture_model(model: nn.Module, args: tuple, kwargs: Dict[str, Any], frontend: str,
                  state: Optional[ModelState] = None, dynamic_shapes: Any = None,
                  whole_graph: bool = False, inference: bool = False,
                  compute: Optional[torch.dtype] = None,
                  settled: Optional[Settled] = None,
                  regions: Tuple[str, ...] = ()) -> Capture:
    """What the first front end (in the order ``frontend`` asks for) that takes ``model``
    gives: a :class:`Traced` graph, or :class:`Children` to rewrite one by one.
    ``whole_graph``: only front ends giving one graph of the whole model (calibration,
    decisions fixed by node name). ``state`` (the model's snapshot) is restored after each
    front end that fails; ``dynamic_shapes`` goes to torch.export. ``inference``: the
    eval-mode graph alone (one trace, not one per mode). ``compute``: the plan's low dtype
    (values the code reads from tensors' dtypes follow autocast's run with it);
    ``settled``: the values read from dtypes the plan does without. When none takes it:
    the one front end's TraceError, or one naming each front end's failure. ``regions``:
    submodules kept as module calls (torch.fx alone keeps them). A quantized
    model, and example inputs on meta for a model on another device, are refused before
    any front end tries (:mod:`.model_checks`)."""
    check_not_quantized(model)
    check_example_device(model, args, kwargs)
    request = Request(tuple(args), dict(kwargs), frontend, state or ModelState(model),
                      dynamic_shapes, inference=inference, compute=compute, settled=settled,
                      regions=tuple(regions))
    order: List[Frontend] = [REGISTRY[name] for name in FRONTEND_ORDER[frontend]]
    if regions:
        order = [FX]
    if whole_graph:
        order = [fe for fe in order if fe.graph]
    for fe in order:
        # (each front end runs the model on its own copies of the argument objects a forward
        # changes in place, a KV cache say: the caller's stay as they were)
        attempt = dataclasses.replace(request, args=own_copies(request.args),
                                      kwargs=own_copies(request.kwargs))
        try:
            with _torch.tracing(), _torch.spelling_names():  # (see _torch.TRACE_PATCHES)
                captured = fe.capture(model, attempt)
        except TraceError as err:
            request.state.restore()
            request.errors[fe.name] = err
            continue
        if captured.kind == "children":
            captured = captured._replace(refused=_refusal(model, order, request.errors))
        return captured
    refused = _refusal(model, order, request.errors)
    if refused is None:  # (an order of eager front ends only, when a graph is needed)
        raise TraceError(f"frontend={frontend!r} gives no graph of the whole model, which "
                         "calibration, fixed decisions, the search and the audit need; "
                         "what to do: ask for frontend='auto', 'fx' or 'export'")
    raise refused


def _refusal(model: nn.Module, tried: List[Frontend],
             errors: Dict[str, TraceError]) -> Optional[TraceError]:
    """The error when no front end takes ``model``: a single front end's own; else one
    naming why each front end that is not a fallback failed (caused by the last error)."""
    if len(errors) <= 1:
        return next(iter(errors.values()), None)
    err = TraceError(f"no front end takes {type(model).__name__}." + "".join(
        f"\n- {fe.name}: {errors[fe.name]}" for fe in tried
        if not fe.fallback and fe.name in errors))
    err.__cause__ = list(errors.values())[-1]
    err.causes = dict(errors)  # type: ignore[attr-defined]
    return err


def trace_model(model: nn.Module, args: tuple, kwargs: Dict[str, Any], frontend: str,
                state: Optional[ModelState] = None, dynamic_shapes: Any = None) -> Traced:
    """One graph of the whole ``model`` (:func:`capture_model` with the graph front ends
    only): for the tolerance search and the audit."""
    traced = capture_model(model, args, kwargs, frontend, state, dynamic_shapes,
                           whole_graph=True)
    assert isinstance(traced, Traced)
    return traced


def graph_frontend(traced: Traced) -> GraphFrontend:
    """The graph front end that took ``traced``."""
    fe = REGISTRY[traced.frontend]
    assert fe.graph, traced.frontend
    return fe  # type: ignore[return-value]


def graph_inputs(model: nn.Module, traced: Traced, args: tuple,
                 kwargs: Dict[str, Any]) -> tuple:
    """The placeholder values of ``traced``'s graph for the call ``model(*args, **kwargs)``."""
    return graph_frontend(traced).inputs(model, traced, args, kwargs)


__all__ = ["FRONTENDS", "FRONTEND_ORDER", "STATIC_SHAPES", "Frontend", "GraphFrontend",
           "Request", "Traced",
           "Children", "Capture", "REGISTRY", "FX", "ATEN", "PARTIAL", "EAGER",
           "MAX_RUNTIME_LEAVES", "capture_model", "trace_model", "graph_frontend",
           "graph_inputs"]
