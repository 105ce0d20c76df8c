"""Grad-mode regions inside ``forward`` (``torch.no_grad()``, ``enable_grad``,
``set_grad_enabled``) are kept in the graph, in both front ends, as the same nodes:

    prev = torch.is_grad_enabled()      # (fx) the mode before the region
    torch._C._set_grad_enabled(False)   # the region's mode
    ... the region's ops ...
    torch._C._set_grad_enabled(prev)    # restored

torch.fx's symbolic tracer does not see context managers: while fxamp traces, the calls
``torch.autograd.grad_mode`` makes are recorded as nodes instead. torch.export records a
region as a ``wrap_with_set_grad_enabled`` higher-order op with a subgraph; fxamp inlines it
between two such calls, so the region's ops are planned like any others. Neither node has a
floating output; the casts pass makes no cast inside a region that it reuses outside it.

Regions that cannot be kept this way are refused (``TraceError`` naming the line):
``torch.inference_mode`` by both front ends (torch.export drops it), a model's own
``torch.autocast`` region by fx (torch.export keeps it as a ``wrap_with_autocast`` call;
under frontend="auto" it takes the model next). Under frontend="auto" a refused submodule
runs as a call under autocast, a refused root forward eagerly.
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
from typing import Any, Iterator

import torch
import torch.fx as fx

from .. import _torch
from .._torch import IS_GRAD, patched
from ..runtime import SET_GRAD

_GRAD_MODE_FILE = os.path.normcase(os.path.abspath(torch.autograd.grad_mode.__file__))
_TORCH_FILE = _torch.__file__


class RegionRefused(RuntimeError):
    """A context manager in forward that fxamp cannot keep in an fx graph."""


@contextlib.contextmanager
def recording(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces (on this thread: see ``_torch.patched``): grad-mode changes
    become graph nodes; inference_mode and torch.autocast regions raise RegionRefused."""
    def is_grad_enabled(original: Any) -> Any:
        if _from_grad_mode():
            return tracer.create_proxy("call_function", IS_GRAD, (), {})
        return original()

    def set_grad_enabled(original: Any, mode: Any) -> None:
        tracer.create_proxy("call_function", SET_GRAD, (mode,), {})

    def refuse_autocast(original: Any, self: Any) -> None:
        raise RegionRefused(
            "the model's own torch.autocast region cannot be kept in an fx graph (fx does "
            "not see context managers); frontend='export' keeps it (frontend='auto' tries "
            "it next)")

    with patched("is_grad_enabled", is_grad_enabled), \
            patched("set_grad_enabled", set_grad_enabled), \
            patched("autocast_enter", refuse_autocast), refusing_inference_mode():
        yield


def _caller(depth: int) -> Any:
    """The frame ``depth`` up from the caller, not counting fxamp's patch dispatch
    (``_torch.patched``) frames: the code that called the patched function."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_code.co_filename == _TORCH_FILE:
        frame = frame.f_back
    return frame


def _from_grad_mode() -> bool:
    """Whether the grad-mode query (the handler calling this) was called from
    torch.autograd.grad_mode (a context manager)."""
    frame = _caller(2)
    return frame is not None and os.path.normcase(
        os.path.abspath(frame.f_code.co_filename)) == _GRAD_MODE_FILE


def _refuse_inference(original: Any, self: Any) -> Any:
    from ..errors import is_library_file

    if is_library_file(_caller(1).f_code.co_filename):  # torch's own use
        return original(self)
    raise RegionRefused(
        "torch.inference_mode() inside forward cannot be kept in a graph (fx does not see "
        "it, torch.export drops it); use torch.no_grad() there (kept by both front ends), "
        "or frontend='auto' runs this code eagerly under torch.autocast")


def refusing_inference_mode() -> "contextlib.AbstractContextManager":
    """``torch.inference_mode()`` raises RegionRefused while a front end traces (on the
    tracing thread)."""
    return patched("inference_mode_enter", _refuse_inference)


def _wrap_set_grad() -> Any:
    return getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def inline_grad_regions(gm: fx.GraphModule) -> bool:
    """Replace each ``wrap_with_set_grad_enabled(mode, submod, *args)`` of an exported graph
    by its subgraph's nodes between ``_set_grad_enabled(mode)`` and a restore of the mode
    before it; True if any was found. Nested regions are inlined too."""
    hop = _wrap_set_grad()
    if hop is None:
        return False
    changed = False
    while True:
        node = next((n for n in gm.graph.nodes
                     if n.op == "call_function" and n.target is hop), None)
        if node is None:
            break
        _inline(gm, node)
        changed = True
    if changed:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return changed


def _inline(gm: fx.GraphModule, node: fx.Node) -> None:
    from ..errors import TraceError

    mode, sub_ref, *args = node.args
    sub = gm.get_submodule(str(sub_ref.target))
    graph = gm.graph
    env: dict = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise TraceError(f"torch.export's grad-mode region {node.name} has "
                         f"{len(placeholders)} inputs for {len(args)} arguments")
    outputs: Any = None
    with graph.inserting_before(node):
        prev = graph.call_function(IS_GRAD, ())
        graph.call_function(SET_GRAD, (mode,))
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = args[placeholders.index(inner)]
            elif inner.op == "output":
                outputs = fx.node.map_arg(inner.args[0], lambda n: env[n])
            elif inner.op == "get_attr":
                name = f"{sub_ref.target}_{inner.target}".replace(".", "_")
                value = sub
                for part in str(inner.target).split("."):
                    value = getattr(value, part)
                if isinstance(value, torch.nn.Module):
                    gm.add_submodule(name, value)
                else:
                    setattr(gm, name, value)
                env[inner] = graph.get_attr(name)
            else:
                new = graph.node_copy(inner, lambda n: env[n])
                env[inner] = new
        graph.call_function(SET_GRAD, (prev,))
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        else:
            raise TraceError(f"torch.export's grad-mode region {node.name} is used by "
                             f"{user.format_node()}; fxamp cannot inline it")
    graph.erase_node(node)
    if not sub_ref.users:
        graph.erase_node(sub_ref)
