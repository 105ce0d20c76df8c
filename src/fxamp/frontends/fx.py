"""Tracing front end: ``torch.fx.symbolic_trace`` with custom autograd Functions kept as leaves."""
from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
import traceback
import typing
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import patched
from ..errors import TraceError, is_library_file, short_path
from . import buffer_writes, calls, checkpointing, grad_mode, stacks
from .checkpoint_regions import outline
from ..runtime import has_call_hooks
from .base import Request, Traced
from .hooks import mark_hooked_runtime
from .common import (PACKED_ADVICE, packed_sequence_failure, training_flags,
                     warn_one_mode)
from .modes import align, follow_mode, module_flag, reads_training

log = logging.getLogger(__name__)


def _has_proxy(values: object) -> bool:
    found = []
    torch.fx.node.map_aggregate(values, lambda v: found.append(v) if isinstance(v, fx.Proxy)
                                else None)
    return bool(found)


def _functions_as_leaves() -> "contextlib.AbstractContextManager":
    """While tracing (on this thread), ``SomeFunction.apply(proxy, ...)`` records one call
    instead of running the Function's forward on proxies (which may branch on dtypes or
    values)."""
    def apply(original, cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, fx.Proxy) or (isinstance(value, (list, tuple, dict))
                                               and _has_proxy(value)):
                tracer = _first_proxy(args, kwargs).tracer
                return tracer.create_proxy("call_function", function_call(cls), args, kwargs)
        return original(cls, *args, **kwargs)

    return patched("function_apply", apply)


_FUNCTION_CALLS: "weakref.WeakKeyDictionary[type, Callable]" = weakref.WeakKeyDictionary()


def function_call(cls: type) -> Callable:
    """A plain function calling ``cls.apply``, the graph's target for a custom Function."""
    call = _FUNCTION_CALLS.get(cls)
    if call is None:
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            return cls.apply(*args, **kwargs)

        call.__name__ = f"{cls.__name__}_apply"
        call.__qualname__ = f"{cls.__qualname__}.apply"
        call.__module__ = cls.__module__
        call.fxamp_function = cls  # type: ignore[attr-defined]
        _FUNCTION_CALLS[cls] = call
    return call


def _first_proxy(args: tuple, kwargs: dict) -> fx.Proxy:
    found: list = []
    torch.fx.node.map_aggregate((args, kwargs), lambda v: found.append(v)
                                if isinstance(v, fx.Proxy) else None)
    return found[0]


class FxampTracer(fx.Tracer):
    """A symbolic tracer that records stack traces and keeps torch.nn modules as leaves,
    and the submodules named in ``leaves`` (partial tracing) too."""

    def __init__(self, leaves: FrozenSet[str] = frozenset(),
                 proxied: FrozenSet[str] = frozenset()) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True  # (only those in ``proxied``: see getattr)
        self.proxied = proxied  # buffers forward updates: their reads are graph nodes
        self._ids: Optional[FrozenSet[int]] = None
        self._by_id: Optional[Tuple[Dict[int, str], Dict[int, str]]] = None
        self.leaves = leaves
        self._stacks = stacks.StackCache()

    def create_node(self, kind: str, target: Any, args: tuple, kwargs: dict,
                    name: Optional[str] = None, type_expr: Any = None) -> fx.Node:
        """fx's create_node; the stack-trace text is fx's, captured more cheaply."""
        if not (self.record_stack_traces and stacks.supported(self)):
            return super().create_node(kind, target, args, kwargs, name, type_expr)
        self.record_stack_traces = False
        try:
            node = super().create_node(kind, target, args, kwargs, name, type_expr)
        finally:
            self.record_stack_traces = True
        if not node.stack_trace:
            text = self._stacks.stack_trace(sys._getframe(1))
            if text:
                node.stack_trace = text
        return node

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        """fx's trace, on this thread only: torch.fx replaces ``nn.Module.__call__`` and
        ``__getattr__`` for the whole process while it traces; on other threads they do
        what torch's do (see :meth:`call_module`, :meth:`getattr`)."""
        self._thread = threading.get_ident()
        return super().trace(root, concrete_args)

    def _elsewhere(self) -> bool:
        """Whether another thread than the tracing one reached this tracer."""
        return threading.get_ident() != getattr(self, "_thread", None)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple,
                    kwargs: Dict[str, Any]) -> Any:
        """fx's; another thread's module call runs the module unchanged."""
        if self._elsewhere():
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: Dict[str, Any]) -> Any:
        """fx's, with the buffers named in ``proxied`` read as ``get_attr`` nodes too (see
        :mod:`.buffer_writes`); another thread reads the attribute itself."""
        if self._elsewhere():
            return attr_val
        if not isinstance(attr_val, torch.Tensor):
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        params, buffers = self._names()
        if isinstance(attr_val, nn.Parameter) and id(attr_val) in params:
            name = params[id(attr_val)]
        elif id(attr_val) in self._proxied_ids() and id(attr_val) in buffers:
            name = buffers[id(attr_val)]
        else:
            return attr_val
        if name not in parameter_proxy_cache:  # (fx's, found by one lookup, not a search)
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def _names(self) -> Tuple[Dict[int, str], Dict[int, str]]:
        """The root's Parameters and buffers by ``id``: their first name (as fx finds
        them), made once per trace. fx searches ``named_parameters()`` /
        ``named_buffers()`` on every read of one, which made the trace of a model with a few
        hundred modules quadratic in their number."""
        if self._by_id is None:
            params: Dict[int, str] = {}
            buffers: Dict[int, str] = {}
            for name, p in self.root.named_parameters():
                params.setdefault(id(p), name)
            for name, b in self.root.named_buffers():
                buffers.setdefault(id(b), name)
            self._by_id = (params, buffers)
        return self._by_id

    def create_arg(self, a: Any) -> Any:
        """fx's, with a ``dict`` subclass holding Proxies (a Hugging Face ``ModelOutput``,
        an ``OrderedDict``) rebuilt by a call of its class, as fx does for dataclasses,
        instead of becoming a plain ``dict``."""
        if isinstance(a, dict) and type(a) is not dict \
                and not isinstance(a, fx.immutable_collections.immutable_dict) \
                and all(isinstance(k, str) and k.isidentifier() for k in a) and _has_proxy(a):
            kwargs = {k: self.create_arg(v) for k, v in a.items()}
            return self.create_node("call_function", type(a), (), kwargs)
        if isinstance(a, torch.Tensor):  # a Parameter or buffer: fx's node, one lookup
            params, buffers = self._names()
            name = (params if isinstance(a, nn.Parameter) else buffers).get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def _proxied_ids(self) -> FrozenSet[int]:
        if not self.proxied:
            return frozenset()
        if self._ids is None:
            self._ids = frozenset(id(b) for n, b in self.root.named_buffers(
                remove_duplicate=False) if n in self.proxied)
        return self._ids

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # a module with hooks stays a call, so that calling it runs them (see hooks.py)
        return module_qualified_name in self.leaves or (
            bool(module_qualified_name) and has_call_hooks(m)) or super().is_leaf_module(
            m, module_qualified_name)


def _user_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not is_library_file(frame.filename):
            return (f'File "{short_path(frame.filename)}", line {frame.lineno}, in '
                    f'{frame.name}: {frame.line}')
    return ""


_CONSTANT = "_tensor_constant"


def _traced_by_fx(module: nn.Module) -> bool:
    """fx traces through the module's code (torch.nn modules stay calls)."""
    return not type(module).__module__.startswith("torch.nn")


def trace(model: nn.Module, leaves: Iterable[str] = (), frontend: str = "fx",
          absent: FrozenSet[str] = frozenset(), inference: bool = False,
          lists: Optional[Dict[str, Any]] = None) -> fx.GraphModule:
    """Trace ``model`` with torch.fx; raise TraceError naming the line and the way out.

    A model whose traced code may read ``training`` (:func:`.modes.reads_training`) is
    traced in both modes; the constants that differ become reads of the flag of the module
    that made them (:mod:`.modes`), so ``train()`` / ``eval()`` keep working on the result.
    Submodules named in ``leaves`` are kept as calls.
    ``frontend`` is the front end the user asked for (it shapes the advice in errors).
    ``absent``: forward parameters defaulting to None that the example leaves out; they are
    traced as None (``concrete_args``: a ``mask is not None`` branch is not taken), and the
    graph asserts they stay None. ``inference``: the eval-mode graph alone, traced once.
    ``lists``: the forward's list and tuple arguments that hold tensors, each traced
    element by element (:func:`list_args`).
    """
    from .state import ModelState

    before = set(vars(model))
    state = ModelState(model, leaves)  # forward ran on Proxies: put caches and counters back
    try:
        return _trace_modes(model, frozenset(leaves), frontend, absent, inference, lists)
    finally:  # fx stores tensor constants on the traced root: keep the user's model clean
        for name in set(vars(model)) - before:
            if name.startswith(_CONSTANT):
                delattr(model, name)
        state.restore()


def _trace_modes(model: nn.Module, leaves: FrozenSet[str], frontend: str,
                 absent: FrozenSet[str] = frozenset(), inference: bool = False,
                 lists: Optional[Dict[str, Any]] = None) -> fx.GraphModule:
    """The graph of ``model`` following its mode (both modes traced where its code may read
    ``training``); ``inference``: the eval-mode graph alone, traced once."""
    proxied: Set[str] = set()  # (buffers forward updates: found once for both modes)
    with training_flags(model, False) if inference else contextlib.nullcontext():
        graph = _trace_graph(model, leaves, frontend, absent, proxied, lists)
    if not inference and reads_training(model, _traced_by_fx):
        mode = model.training
        with training_flags(model, not mode):  # (fails: fx does not take the model, so
            other = _trace_graph(model, leaves, frontend,  # auto tries export's two modes)
                                 absent, proxied, lists)
        train, eval_ = (graph, other) if mode else (other, graph)
        aligned = align(train, eval_, (model, model))
        if aligned is None or not follow_mode(graph, aligned, mode, module_flag):
            gm = _graph_module(model, graph)
            warn_one_mode(model, gm, mode, "traces")
            return gm
        checkpointing.share_modes(checkpointing.aligned_pairs(aligned, mode))
    return _graph_module(model, graph)


def _graph_module(model: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``torch.fx.GraphModule(model, graph)``; where fx writes code Python cannot compile,
    a TraceError (the next front end takes the model). fx's code for a forward taking
    ``**kwargs`` with a tuple argument traced as its items (HF's ``position_embeddings``)
    binds ``**kwargs`` and the items' defaults in one assignment, a SyntaxError
    (GPT-NeoX-Japanese's layer)."""
    try:
        return fx.GraphModule(model, graph, type(model).__name__)
    except SyntaxError as err:
        raise TraceError(f"torch.fx wrote code for {type(model).__name__}.forward that "
                         f"Python cannot compile ({err.msg}: {(err.text or '').strip()[:120]})"
                         ) from err


#: what to do when fx fails, by the front end asked for (never advise the one in use)
_FX_ADVICE = {
    "fx": "use frontend='auto' (the default): it tries torch.export (frontend='export', "
          "which takes shape-dependent code given example inputs) and then traces around "
          "untraceable submodules, running them under torch.autocast; or make that code "
          "traceable (no Python control flow on tensor values)",
    "auto": "make that code traceable: no Python control flow on tensor values (use "
            "torch.where, or torch.cond for whole branches); or move it out of forward",
}


def _trace_graph(model: nn.Module, leaves: FrozenSet[str] = frozenset(),
                 frontend: str = "fx", absent: FrozenSet[str] = frozenset(),
                 proxied: Optional[Set[str]] = None,
                 lists: Optional[Dict[str, Any]] = None) -> fx.Graph:
    """One fx trace of ``model``, taken again while forward updates a buffer that the
    trace reads as a constant; ``proxied`` (filled in) holds the buffers read as nodes."""
    proxied = set() if proxied is None else proxied
    buffers = buffer_writes.buffer_targets(model)
    while True:
        tracer = FxampTracer(leaves, frozenset(proxied))
        try:
            with _functions_as_leaves(), grad_mode.recording(tracer), \
                    checkpointing.fx_recording(tracer, model.training), \
                    buffer_writes.recording(tracer, model, proxied), \
                    buffer_writes.guarding(buffers):
                concrete = {**{n: None for n in absent}, **(lists or {})}
                graph = tracer.trace(model, concrete_args=concrete or None)
            _own_names(graph, absent)
            _no_string_types(graph)
        except buffer_writes.BufferUpdated as updated:
            if updated.target in proxied:  # (cannot happen: a Proxy is no buffer)
                raise
            # trace again, reading that buffer (and its siblings) as a node
            proxied |= buffer_writes.same_code_buffers(model, updated.target)
            continue
        except Exception as exc:  # noqa: BLE001 - any tracing failure becomes a TraceError
            advice = _FX_ADVICE.get(frontend, _FX_ADVICE["auto"])
            if isinstance(exc, (grad_mode.RegionRefused, buffer_writes.BufferRefused)):
                advice = str(exc)
            elif packed_sequence_failure(exc):
                advice = PACKED_ADVICE
            raise trace_error(
                f"torch.fx.symbolic_trace cannot trace {type(model).__name__}", exc, model,
                advice) from exc
        buffer_writes.snapshot_reads(graph)
        return graph


#: the text annotations :func:`_no_string_types` reads as the types they name
_NAMED_TYPES = {"torch.Tensor": torch.Tensor, "Tensor": torch.Tensor, "float": float,
                "int": int, "bool": bool, "str": str}


def _no_string_types(graph: fx.Graph) -> None:
    """The type annotations fx read as text (a module written with ``from __future__
    import annotations``: ``x: torch.Tensor`` is ``"torch.Tensor"``) as the types they
    name, ``typing.Any`` for any other. fx's code generator makes each text a global of
    the graph's code, and torch before 2.11 fails to pickle a GraphModule holding a string
    global. (Dropped instead, a placeholder with a default value would lose the annotation
    fx's pytree code generator cuts its signature at.)"""
    for node in graph.nodes:
        if isinstance(node.type, str):
            node.type = _NAMED_TYPES.get(node.type, typing.Any)


def _own_names(graph: fx.Graph, absent: FrozenSet[str]) -> None:
    """Give the placeholders fx made for the arguments traced as None (``mask_1``) the
    forward's own names, so the graph's forward takes ``mask=`` like the model's."""
    for node in graph.find_nodes(op="placeholder"):
        name = str(node.target)
        if name.endswith("_1") and name[:-2] in absent:
            node.target = name[:-2]


def trace_error(problem: str, exc: BaseException, model: nn.Module, fix: str) -> TraceError:
    """A TraceError naming the failure, the user's line, the failing submodule (also kept
    as ``.module`` for partial tracing) and what to do."""
    text = str(exc).strip()
    msg = f"{problem}: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    where = _user_frame(exc)
    if where:
        msg += f"\n  source: {where}"
    module = failing_module(exc, model)
    if module:
        msg += f"\n  module: {module}"
    err = TraceError(msg + f"\n  what to do: {fix}")
    err.module = module  # type: ignore[attr-defined]
    return err


def failing_module(exc: BaseException, model: nn.Module) -> str:
    """The path of the innermost submodule of ``model`` whose forward was running when
    ``exc`` was raised ("" for the root or none)."""
    paths = {id(m): name for name, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            found = paths[id(owner)]
        tb = tb.tb_next
    return found


def absent_defaults(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> FrozenSet[str]:
    """The forward's parameters the example gives as None or leaves out where they default
    to None: they are traced as None."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for name, p in signature.parameters.items()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                     and (bound.arguments[name] is None if name in bound.arguments
                          else p.default is None))


def _placeholders(value: Any) -> Any:
    """``value`` with each tensor an ``fx.PH`` (a placeholder of its own), through lists,
    tuples and dicts; other values stay (fx bakes them in and asserts them)."""
    if isinstance(value, torch.Tensor):
        return fx.PH
    if isinstance(value, (list, tuple)):
        return type(value)(_placeholders(v) for v in value)
    if isinstance(value, dict):
        return {k: _placeholders(v) for k, v in value.items()}
    return value


def list_args(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """fx's ``concrete_args`` for the forward's arguments that are plain lists or tuples
    holding tensors (timm's SelecSLS blocks take ``[x, skip]``): each tensor in them a
    placeholder of its own (``fx.PH``). fx would otherwise trace the list as one Proxy, and
    ``isinstance(x, list)`` or ``x[0]`` in forward would trace the wrong program. The graph
    takes the list as the model does and flattens it (fx's pytree code generator)."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: _placeholders(value) for name, value in bound.items()
            if signature.parameters[name].kind in named and calls.holds_tensors(value)}


def scalar_args(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """fx's ``concrete_args`` for the forward's Python scalar arguments (bools, ints,
    floats, strings; given or defaulted) as the call has them: traced as constants, which
    the graph's call-structure check compares on every call (another value is a miss)."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    bound.apply_defaults()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: value for name, value in bound.arguments.items()
            if signature.parameters[name].kind in named
            and isinstance(value, (bool, int, float, str))}


def fx_inputs(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """An fx graph's placeholder values: the forward's parameters bound in order."""
    if not kwargs:
        return args
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


#: ``GraphModule.meta`` key: the trace holds the call's Python scalars as constants
_SCALARS = "fxamp_scalars_fixed"


class FxFrontend:
    """torch.fx symbolic tracing of the whole model (see :func:`trace`); hooked submodules
    stay calls run under autocast."""

    name = "fx"
    fallback = False
    graph = True

    def capture(self, model: nn.Module, request: Request) -> Traced:
        absent = absent_defaults(model, request.args, request.kwargs)
        lists = list_args(model, request.args, request.kwargs)
        try:
            gm = trace(model, request.regions, request.asked, absent, request.inference, lists)
        except TraceError:
            if not request.regions:
                raise
            # (block mode's glue, which no other front end takes: its Python scalars
            # traced as the call has them, each value another graph)
            request.state.restore()
            gm = trace(model, request.regions, request.asked, absent, request.inference,
                       {**scalar_args(model, request.args, request.kwargs), **lists})
            gm.meta[_SCALARS] = True
        checkpointing.warn_unseen(model, gm.graph)
        return Traced(gm, self.name, fx_inputs(model, request.args, request.kwargs), [])

    def inputs(self, model: nn.Module, traced: Traced, args: tuple,
               kwargs: Dict[str, Any]) -> tuple:
        return fx_inputs(model, args, kwargs)

    def calibration(self, traced: Traced, batches: Iterable[Any]) -> Iterable[Any]:
        return batches  # (the forward's positional inputs are the placeholders)

    def runtime_calls(self, traced: Traced) -> List[str]:
        return mark_hooked_runtime(traced.graph_module)

    def finish(self, gm: fx.GraphModule, traced: Traced, model: nn.Module, args: tuple,
               kwargs: Dict[str, Any]) -> Optional[calls.CallStructure]:
        outline(gm)  # checkpoint regions run under torch.utils.checkpoint again
        return calls.call_structure(gm, model, args, kwargs,
                                    values=traced.graph_module.meta.get(_SCALARS, False))


#: partial tracing gives up after this many untraceable submodules
MAX_RUNTIME_LEAVES = 32


def _partial_trace(model: nn.Module, error: TraceError, state: Any,
                   absent: FrozenSet[str] = frozenset(), inference: bool = False,
                   lists: Optional[Dict[str, Any]] = None
                   ) -> Tuple[fx.GraphModule, List[str]]:
    """fx tracing with each submodule that fails kept as a call (run under autocast)."""
    leaves: List[str] = []
    while True:
        path = getattr(error, "module", "")
        if not path or path in leaves or len(leaves) >= MAX_RUNTIME_LEAVES:
            raise error
        leaves.append(path)
        try:
            return trace(model, leaves, "auto", absent, inference, lists), leaves
        except TraceError as err:
            error = err
            state.restore()


class PartialFrontend(FxFrontend):
    """fx+runtime (a fallback after fx and export): fx tracing with each submodule that
    fails kept as a call (``leaves``: the rewriter tries each on its own, the others run
    under autocast, ``rule="runtime"``), starting from the fx front end's error."""

    name = "fx+runtime"
    fallback = True

    def capture(self, model: nn.Module, request: Request) -> Traced:
        error = request.errors.get("fx")
        if error is None:
            raise TraceError("partial tracing starts from the fx front end's error; what "
                             "to do: ask for frontend='auto'")
        gm, leaves = _partial_trace(model, error, request.state,
                                    absent_defaults(model, request.args, request.kwargs),
                                    request.inference,
                                    list_args(model, request.args, request.kwargs))
        log.info("%s: torch.fx and torch.export fail; traced around %s",
                 type(model).__name__, ", ".join(leaves))
        return Traced(gm, self.name, fx_inputs(model, request.args, request.kwargs), leaves)

