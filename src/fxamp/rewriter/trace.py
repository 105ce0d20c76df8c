"""Tracing front end: ``torch.fx.symbolic_trace`` with custom autograd Functions kept as leaves."""
from __future__ import annotations

import contextlib
import logging
import traceback
import weakref
from typing import Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import TraceError

log = logging.getLogger(__name__)


def _has_proxy(values: object) -> bool:
    found = []
    torch.fx.node.map_aggregate(values, lambda v: found.append(v) if isinstance(v, fx.Proxy)
                                else None)
    return bool(found)


@contextlib.contextmanager
def _functions_as_leaves() -> Iterator[None]:
    """While tracing, ``SomeFunction.apply(proxy, ...)`` records one call instead of
    running the Function's forward on proxies (which may branch on dtypes or values)."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, fx.Proxy) or (isinstance(value, (list, tuple, dict))
                                               and _has_proxy(value)):
                tracer = _first_proxy(args, kwargs).tracer
                return tracer.create_proxy("call_function", function_call(cls), args, kwargs)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[assignment]


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
    """A symbolic tracer that records stack traces and keeps torch.nn modules as leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True


def _user_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/fxamp/" not in path:
            return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {frame.line}'
    return ""


def trace(model: nn.Module) -> fx.GraphModule:
    """Trace ``model`` with torch.fx; raise TraceError naming the line and the way out."""
    tracer = FxampTracer()
    try:
        with _functions_as_leaves():
            graph = tracer.trace(model)
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes a TraceError
        where = _user_frame(exc)
        msg = (f"torch.fx.symbolic_trace cannot trace {type(model).__name__}: "
               f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if where:
            msg += f"\n  source: {where}"
        msg += ("\n  what to do: make that code traceable (no Python control flow on tensor "
                "values or shapes), move it into a submodule and mark it a leaf, or wait for "
                "the torch.export front end (frontend='export')")
        raise TraceError(msg) from exc
    name = type(model).__name__
    return fx.GraphModule(tracer.root, graph, name)
