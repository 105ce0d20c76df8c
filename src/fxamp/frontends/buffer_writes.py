"""Buffer updates in ``forward`` are part of the fx graph, as they are of torch.export's.

torch.fx computes with a buffer as a constant when no Proxy is involved, so an update made
with tensor ops on it alone (``self.ema.mul_(0.9)``, ``self.num_batches_tracked.add_(1)``,
``self.steps += 1``) would run once, on the real buffer, while fxamp traces, and never
again. While fxamp traces, such an update stops the trace before it runs
(:func:`guarding` raises :class:`BufferUpdated`); the trace is taken again with reads of
that buffer as ``get_attr`` nodes, so the update is recorded and repeated on every call.
Buffers that forward does not update stay as fx has them (the node names stay
``symbolic_trace``'s). A buffer *assigned* in forward
(``self.steps = self.steps + 1``, ``self.ema = 0.9 * self.ema + ...``) becomes a
:func:`~fxamp.runtime.write_buffer_` call at that point: the new value is written into the
buffer (its shape and dtype are checked at run time), so the model, the rewritten module
and their ``state_dict`` hold it. The reads of the buffer before such a write read a clone
taken at the first of them, so what they hold (aliases, tensors saved for backward) keeps
the old value, as after a rebinding in eager code.

Setting a buffer to ``None`` in forward is refused (:class:`BufferRefused`, naming the line).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Set

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .._torch import patched
from ..runtime import write_buffer_


class BufferRefused(RuntimeError):
    """A buffer change in forward that the graph cannot repeat."""


class BufferUpdated(RuntimeError):
    """Tracing stopped before an update of a buffer fx does not record (``target``)."""

    def __init__(self, target: str) -> None:
        super().__init__(f"forward updates buffer {target!r}")
        self.target = target


_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
    "rshift", "matmul"))


def _in_place(func: object) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


class _Guard(TorchFunctionMode):
    def __init__(self, buffers: Dict[int, str]) -> None:
        super().__init__()
        self.buffers = buffers

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = kwargs.get("out")
        for value in ([args[0]] if args and _in_place(func) else []) + (
                list(out) if isinstance(out, (list, tuple)) else [out]):
            if isinstance(value, torch.Tensor) and id(value) in self.buffers:
                raise BufferUpdated(self.buffers[id(value)])
        return func(*args, **kwargs)


def buffer_targets(root: nn.Module) -> Dict[int, str]:
    """Each buffer of ``root`` by ``id``: its target (qualified name)."""
    return {id(b): name for name, b in root.named_buffers(remove_duplicate=False)}


def same_code_buffers(root: nn.Module, target: str) -> Set[str]:
    """``target`` and the buffers of the same name in the other modules of its module's
    class (every BatchNorm's ``num_batches_tracked``): the same code updates them all, so
    one trace again reads them all as nodes, not one trace per module."""
    path, _, name = target.rpartition(".")
    cls = type(root.get_submodule(path))
    return {target} | {f"{p}.{name}" if p else name
                       for p, m in root.named_modules(remove_duplicate=False)
                       if type(m) is cls and name in dict(m.named_buffers(recurse=False))}


@contextlib.contextmanager
def guarding(buffers: Dict[int, str]) -> Iterator[None]:
    """Raise :class:`BufferUpdated` before an in-place op (or ``out=``) on one of
    ``buffers`` (real tensors: the ones the trace does not read as Proxies)."""
    with _Guard(buffers):
        yield


@contextlib.contextmanager
def recording(tracer: fx.Tracer, root: nn.Module, proxied: Set[str]) -> Iterator[None]:
    """While ``tracer`` traces ``root``: assignments to its modules' buffers become
    :func:`write_buffer_` nodes (the module keeps its buffer). A buffer assigned while it
    is read as a constant (not in ``proxied``) raises :class:`BufferUpdated`: the value may
    have been computed from the trace's value of it."""
    owners: Dict[int, str] = {id(m): (f"{p}." if p else "")
                              for p, m in root.named_modules(remove_duplicate=False)}

    def setattr_(previous: Any, module: nn.Module, name: str, value: object) -> None:
        buffers = module.__dict__.get("_buffers")
        if buffers is None or name not in buffers or id(module) not in owners:
            previous(module, name, value)
            return
        target = owners[id(module)] + name
        if value is None:
            raise BufferRefused(
                f"forward sets buffer {target!r} to None; the rewritten graph cannot repeat "
                "that: keep the buffer and write zeros into it, or move this out of forward")
        if not isinstance(value, (fx.Proxy, torch.Tensor)) or isinstance(value, nn.Parameter):
            previous(module, name, value)
            return
        if target not in proxied:  # (its reads so far were constants)
            raise BufferUpdated(target)
        buffer = tracer.create_proxy("get_attr", target, (), {})
        tracer.create_proxy("call_function", write_buffer_, (buffer, value), {},
                            name=f"{target.replace('.', '_')}_write")

    with patched("module_setattr", setattr_):
        yield


def is_buffer_write(node: fx.Node) -> bool:
    """A :func:`write_buffer_` node (a buffer assigned in forward)."""
    return node.op == "call_function" and node.target is write_buffer_


def snapshot_reads(graph: fx.Graph) -> None:
    """Reads of a buffer before one of its :func:`write_buffer_` writes read a clone taken
    at the first of them (see the module docstring)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    reads: Dict[str, List[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            reads.setdefault(str(node.target), []).append(node)
    writes = [n for n in graph.nodes if is_buffer_write(n)]
    for write in writes:
        target = str(write.args[0].target)
        earlier = [w for w in writes if str(w.args[0].target) == target
                   and order[w] < order[write]]
        start = max((order[w] for w in earlier), default=-1)
        users = sorted({u for attr in reads.get(target, ()) for u in attr.users
                        if start < order[u] < order[write]
                        and not (is_buffer_write(u) and u.args[0] is attr)},
                       key=order.__getitem__)
        if not users:
            continue
        with graph.inserting_before(users[0]):
            attr = graph.get_attr(target)
            clone = graph.call_method("clone", (attr,))
        for user in users:
            for source in reads[target]:
                user.replace_input_with(source, clone)


def _writes_first_arg(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return bool(alias is not None and alias.is_write)


def _same_buffer(value: object, target: str) -> bool:
    """Whether ``value`` is the buffer ``target`` itself (read, or returned by in-place
    ops on it)."""
    while isinstance(value, fx.Node) and _writes_first_arg(value) and value.args:
        value = value.args[0]
    return isinstance(value, fx.Node) and value.op == "get_attr" and value.target == target


def _called_copy(node: fx.Node) -> bool:
    """Whether the model's own code called ``copy_`` here (torch.export's ``torch_fn``)."""
    called = node.meta.get("torch_fn")
    return bool(called) and str(called[-1]).endswith("copy_")


def export_write_backs(gm: fx.GraphModule) -> None:
    """torch.export writes each buffer assigned in forward back with an ``aten.copy_`` of
    its own (its ``torch_fn`` is the call that made the value) at the end of the graph, after the
    reads, so tensors saved for backward change under autograd. Here a write-back of a
    buffer into itself (``+=``, in-place updates) is dropped, and the others become
    :func:`write_buffer_` writes whose earlier reads read a clone (see
    :func:`snapshot_reads`)."""
    graph = gm.graph
    found = False
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
                and not node.users and not _called_copy(node)
                and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"):
            continue
        found = True
        if _same_buffer(node.args[1], str(node.args[0].target)):
            graph.erase_node(node)
            continue
        with graph.inserting_before(node):
            write = graph.call_function(write_buffer_, tuple(node.args))
        write.meta.update(node.meta)
        graph.erase_node(node)
    if found:
        snapshot_reads(graph)
        gm.recompile()
