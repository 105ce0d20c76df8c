"""Front ends: how a model becomes a graph the passes can read.

Each graph front end is an object with a ``name`` and ``capture(model, args, kwargs, asked)``
returning a :class:`Traced` (graph module, front end that took it, placeholder values,
runtime leaves); :func:`trace_model` runs them in the order ``frontend`` asks for:

- ``fx`` (:mod:`.fx`): ``torch.fx`` symbolic tracing, torch-function level;
- ``export`` (:mod:`.aten`): ``torch.export`` (non-strict), ATen level, needs example inputs;
- ``fx+runtime``: fx with the submodules neither takes kept as calls (``auto`` only);
- ``eager`` (:mod:`.eager`): the model's own forward stays Python, its children are rewritten
  on their own by the layer above (the rewriter) and assembled by :func:`.eager.eager_root`.

What they share (train/eval flags, the one-mode warning, nested plans) is in :mod:`.common`.
This package imports only the layers below it (core modules and ``passes``).
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Tuple

import torch.fx as fx
import torch.nn as nn

from ..config import FRONTENDS
from ..errors import TraceError
from . import fx_names  # noqa: F401 - fixes fx codegen of names with quotes
from .aten import export_trace
from .aten_inputs import flat_inputs
from .fx import trace
from .hooks import hooked_modules, without_root_hooks
from .state import ModelState

log = logging.getLogger(__name__)

#: partial tracing gives up after this many untraceable submodules
MAX_RUNTIME_LEAVES = 32


class Traced(NamedTuple):
    """A captured graph: the module, the front end that took it, its placeholder values
    and the submodules kept as runtime calls."""

    graph_module: fx.GraphModule
    frontend: str
    inputs: tuple
    leaves: List[str]


class Frontend(Protocol):
    """A graph front end: ``capture`` raises TraceError naming the line and the way out."""

    name: str

    def capture(self, model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                asked: str) -> Traced:
        """The graph of ``model`` called on ``(args, kwargs)``; ``asked`` is the front end
        the user asked for (it shapes the advice in errors)."""
        ...


def _fx_inputs(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The fx graph's placeholder values: the forward's parameters bound in order."""
    if not kwargs:
        return args
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def graph_inputs(model: nn.Module, traced: Traced, args: tuple,
                 kwargs: Dict[str, Any]) -> tuple:
    """The placeholder values of ``traced``'s graph for the call ``model(*args, **kwargs)``."""
    if traced.frontend == "export":
        return flat_inputs(traced.graph_module, args, kwargs)
    return _fx_inputs(model, args, kwargs)


def _refuse_hooks_in_export(model: nn.Module) -> None:
    """torch.export runs hooks once, at export time, on fake tensors: refused."""
    hooked = hooked_modules(model)
    if hooked:
        path, names = next(iter(hooked.items()))
        raise TraceError(
            f"torch.export would run the hooks of {type(model).__name__}.{path} ("
            f"{', '.join(names)}) once while exporting instead of on every call"
            + (f" (and {len(hooked) - 1} more hooked modules)" if len(hooked) > 1 else "")
            + "\n  what to do: frontend='fx' or 'auto' keep hooked modules as calls that run "
            "their hooks; or remove the hooks before amp_rewrite")


class FxFrontend:
    """torch.fx symbolic tracing (see :mod:`.fx`)."""

    name = "fx"

    def capture(self, model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                asked: str = "fx") -> Traced:
        return Traced(trace(model, (), asked), "fx", _fx_inputs(model, args, kwargs), [])


class AtenFrontend:
    """torch.export, ATen level (see :mod:`.aten`); refuses hooked modules."""

    name = "export"

    def capture(self, model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                asked: str = "export", dynamic_shapes: Any = None) -> Traced:
        _refuse_hooks_in_export(model)
        with without_root_hooks(model):
            gm = export_trace(model, args, kwargs, asked, dynamic_shapes)
        return Traced(gm, "export", flat_inputs(gm, args, kwargs), [])


FX = FxFrontend()
ATEN = AtenFrontend()


def _partial_trace(model: nn.Module, error: TraceError, state: ModelState
                   ) -> Tuple[fx.GraphModule, List[str]]:
    """fx tracing with each submodule that fails kept as a call (run under autocast)."""
    leaves: List[str] = []
    while True:
        path = getattr(error, "module", "")
        if not path or path in leaves or len(leaves) >= MAX_RUNTIME_LEAVES:
            raise error
        leaves.append(path)
        try:
            return trace(model, leaves, "auto"), leaves
        except TraceError as err:
            error = err
            state.restore()


def trace_model(model: nn.Module, args: tuple, kwargs: Dict[str, Any], frontend: str,
                state: Optional[ModelState] = None, dynamic_shapes: Any = None) -> Traced:
    """The graph of ``model`` from the front end ``frontend`` names ("auto": fx, then
    export, then fx with runtime leaves). ``state`` (the model's snapshot) is restored
    after each front end that fails; ``dynamic_shapes`` goes to torch.export."""
    state = state or ModelState(model)
    if frontend == "export":
        return ATEN.capture(model, args, kwargs, "export", dynamic_shapes)
    try:
        return FX.capture(model, args, kwargs, frontend)
    except TraceError as err:
        state.restore()
        if frontend == "fx":
            raise
        fx_error = err
    try:
        traced = ATEN.capture(model, args, kwargs, "auto", dynamic_shapes)
        log.info("torch.fx could not trace %s; torch.export took it", type(model).__name__)
        return traced
    except TraceError as err:
        export_error = err
        state.restore()
    try:
        gm, leaves = _partial_trace(model, fx_error, state)
    except TraceError as err:
        raise TraceError(f"no front end takes {type(model).__name__}.\n- fx: {fx_error}\n"
                         f"- export: {export_error}") from err
    log.info("%s: torch.fx and torch.export fail; traced around %s",
             type(model).__name__, ", ".join(leaves))
    return Traced(gm, "fx+runtime", _fx_inputs(model, args, kwargs), leaves)


__all__ = ["FRONTENDS", "Frontend", "Traced", "FX", "ATEN", "trace_model", "graph_inputs"]
