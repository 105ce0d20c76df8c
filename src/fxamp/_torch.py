"""torch's private API, in one place: everything a torch upgrade can break.

fxamp needs a few of torch's names that are not public API (pytree flattening, fake-tensor
exceptions, ``TorchDispatchMode``, ``_reparametrize_module``, the raw grad-mode switch,
dispatcher and storage counters, the graph's code generator, a node's erased flag and the
graph's name table, ``OpOverload``, the fused ``_foreach_copy_``), and every attribute a
trace replaces (:data:`TRACE_PATCHES`: name, owner, attribute, what it does; applied by
:func:`patched`, thread-aware, under one re-entrant trace lock, never at import; reset in a
forked child, with torch.fx's module wrappers, when another thread held it). Every module
of fxamp reaches them through this module, so a torch upgrade is checked
(tests/test_torch_compat.py, also run on the oldest supported torch with ``pytest -m
floor``) and mended here alone.

What stays elsewhere: the op vocabulary (``fxamp.oplists``, ``fxamp.autocast_tables``,
``fxamp.ops``) keeps the op *spellings* a graph's targets have (``torch._C._nn.linear``,
``torch._VF.lstm``, ``aten.*`` overloads): they are data a node is matched against, not API
fxamp calls. Logger names (``torch._export``) and docstrings mentioning private names are
text, not uses.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.fx as fx
import torch.fx._pytree as _fx_pytree
import torch.fx.graph as _fx_graph
import torch.utils._pytree as _pytree
from torch._export.verifier import TrainingIRVerifier
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensorMode,
                                           unset_fake_temporarily)
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "tree_flatten", "tree_unflatten", "tree_map", "tree_leaves", "keystr",
    "tree_flatten_with_path", "tree_flatten_spec", "PYTREE_REGISTER",
    "reparametrize_module", "DataDependentOutputException", "DynamicOutputShapeException",
    "FakeTensorMode", "unset_fake_temporarily", "TorchDispatchMode", "OpOverload",
    "OpOverloadPacket", "TRAINING_VERIFIER",
    "SET_GRAD", "IS_GRAD", "has_kernel_for_dispatch_key",
    "storage_use_count", "tensor_use_count", "in_dispatch_or_function_mode",
    "is_functorch_wrapped", "functorch_active", "graph_codegen", "direct_codegen", "node_erased",
    "input_guard_conditions", "fast_call", "RuntimeTracer",
    "rename_node", "foreach_copy_", "eager_compiler_flags",
    "Patch", "TRACE_PATCHES", "tracing", "tracing_thread", "patched", "format_target",
    "spelling_names", "spell_names", "SpellingTracer",
]

#: pytree helpers (``torch.utils._pytree``): flatten/unflatten nested containers of tensors
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves
keystr = _pytree.keystr
tree_flatten_with_path = _pytree.tree_flatten_with_path
#: flatten a value along an exported program's input spec (``torch.fx._pytree``)
tree_flatten_spec = _fx_pytree.tree_flatten_spec


def first_child_spec(spec: Any) -> Any:
    """The first child of pytree ``spec`` (an ``ExportedProgram``'s ``in_spec``: the spec
    of its positional arguments), or None when it has none. ``TreeSpec.child`` where torch
    has it (``children_specs`` is deprecated there), else ``children_specs``."""
    if spec is None or not spec.num_children:
        return None
    return spec.child(0) if hasattr(spec, "child") else spec.children_specs[0]
#: the spelling of torch's pytree registration, named in error advice
PYTREE_REGISTER = "torch.utils._pytree.register_pytree_node"

#: ``torch.nn.utils.stateless._reparametrize_module``: a context manager that runs a module
#: with some parameters/buffers swapped for given tensors (``tie_weights``, ``strict``)
reparametrize_module = _reparametrize_module

#: the verifier of ``torch.export``'s own programs (``torch._export.verifier``, dialect
#: "TRAINING": in-place ATen ops allowed), for an ExportedProgram built from such a graph
TRAINING_VERIFIER = TrainingIRVerifier

#: the raw grad-mode switch a graph calls at a kept ``torch.no_grad`` region's boundaries
SET_GRAD = torch._C._set_grad_enabled
#: the grad-mode query a traced region boundary records
IS_GRAD = torch._C.is_grad_enabled


def has_kernel_for_dispatch_key(name: str, key: str) -> bool:
    """Whether the dispatcher has a kernel for operator ``name`` (``ns::op.overload``) under
    dispatch key ``key`` (``"AutocastCPU"``)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, key))


def tensor_use_count(t: torch.Tensor) -> int:
    """How many references hold tensor ``t``'s implementation (``Tensor._use_count``)."""
    return t._use_count()  # noqa: SLF001


def storage_use_count(t: torch.Tensor) -> int:
    """How many references hold ``t``'s storage (``torch._C._storage_Use_Count``),
    counting the storage handle read for it: 2 when ``t`` alone holds it."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def in_dispatch_or_function_mode() -> bool:
    """Whether a ``TorchDispatchMode`` or ``TorchFunctionMode`` is active."""
    return bool(torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled())


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (under vmap/grad transforms)."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


#: whether a ``torch.func`` transform (grad, vmap, jvp, ...) is running on this thread
functorch_active = torch._C._are_functorch_transforms_active


def graph_codegen(graph: fx.Graph) -> Any:
    """A graph's code generator (``Graph._codegen``: how its forward's signature and pytree
    in/out specs are written), to give another graph with ``set_codegen``."""
    return graph._codegen


def direct_codegen(graph: fx.Graph) -> Any:
    """:func:`graph_codegen`, where it is an exported graph's pytree code generator whose
    input spec allows, as :class:`_DirectInputs` (for the code a graph runs: the graph
    keeps its own); None where it is not."""
    codegen = graph._codegen
    if type(codegen) is _fx_graph._PyTreeCodeGen and codegen.pytree_info is not None \
            and codegen.pytree_info.in_spec is not None \
            and _input_leaves(codegen.pytree_info) is not None:
        return _DirectInputs(codegen.pytree_info)
    return None


def _spec_leaves(expr: str, spec: Any) -> Optional[List[str]]:
    """The expressions of the leaves of a value ``expr`` laid out as pytree ``spec``, as
    ``tree_flatten_spec`` reads them (``expr[0]`` of a tuple, ``expr['k']`` of a dict);
    None where ``spec`` holds another container type."""
    if spec.is_leaf():
        return [expr]
    if spec.type in (tuple, list):
        keys = [str(i) for i in range(spec.num_children)]
    elif spec.type is dict and all(type(k) is str for k in spec.context):
        keys = [repr(k) for k in spec.context]
    else:
        return None
    out: List[str] = []
    for i, key in enumerate(keys):
        leaves = _spec_leaves(f"{expr}[{key}]", spec.child(i))
        if leaves is None:
            return None
        out += leaves
    return out


def _input_leaves(info: Any) -> Optional[List[str]]:
    """The expressions of an exported graph's input leaves, from its forward's arguments
    (:func:`_spec_leaves` of each); None where the spec is not plain tuples, lists and
    dicts, or does not lay out those arguments one to one."""
    spec, names = info.in_spec, list(info.orig_args)
    if spec.type is tuple and spec.num_children == 2 and spec.child(0).type is tuple \
            and spec.child(1).type is dict:  # (args, kwargs): as fx's code generator binds
        args, kwargs = spec.child(0), spec.child(1)
        if len(names) != args.num_children + kwargs.num_children:
            return None
        roots = [*((names[i], args.child(i)) for i in range(args.num_children)),
                 *((names[args.num_children + i], kwargs.child(i))
                   for i in range(kwargs.num_children))]
    elif spec.type in (tuple, list) and spec.num_children == len(names):
        roots = [(names[i], spec.child(i)) for i in range(spec.num_children)]
    else:
        return None
    out: List[str] = []
    for name, child in roots:
        leaves = _spec_leaves(name, child)
        if leaves is None:
            return None
        out += leaves
    return out


class _DirectInputs(_fx_graph._PyTreeCodeGen):
    """fx's pytree code generator, binding the graph's inputs by indexing the forward's
    arguments (``position_embeddings[0]``) instead of a ``tree_flatten_spec`` call: the same
    reads (that function indexes each tuple, list and dict along the spec, with no check
    of its own), without its dozen Python calls per nested argument on every call."""

    def gen_var_bindings(self, fn_args: List[str], free_vars: List[str],
                         expanded_def: bool) -> str:
        leaves = _input_leaves(self.pytree_info)
        if leaves is None or len(leaves) != len(free_vars):
            return super().gen_var_bindings(fn_args, free_vars, expanded_def)
        names = [x.split(":")[0].split("#")[0] for x in free_vars]
        return (self._format_annotations(free_vars, expanded_def)
                + f"\n    {', '.join(names)}, = {', '.join(leaves)},")


#: the submodule torch.export's unlifted module calls to check its inputs' shapes
INPUT_GUARD = "_guards_fn"


def is_input_guard(node: fx.Node) -> bool:
    """Whether ``node`` calls torch.export's input-shape check (``_guards_fn``).

    Args:
        node: a node of an exported graph.
    """
    return node.op == "call_module" and node.target == INPUT_GUARD


#: the Python binding each common aten op of an exported graph is called through in the
#: graph's generated code (:func:`fast_call`): a function, or a Tensor method's name
_FAST: Dict[Any, Any] = {}


def _fast_table() -> Dict[Any, Any]:
    aten, nn_ops = torch.ops.aten, torch._C._nn
    functions = {
        aten.linear.default: nn_ops.linear, aten.silu.default: nn_ops.silu,
        aten.gelu.default: nn_ops.gelu,
        aten.scaled_dot_product_attention.default: nn_ops.scaled_dot_product_attention,
        aten.embedding.default: torch.embedding, aten.layer_norm.default: torch.layer_norm,
        aten.mul.Tensor: torch.mul, aten.add.Tensor: torch.add, aten.sub.Tensor: torch.sub,
        aten.div.Tensor: torch.div, aten.pow.Tensor_Scalar: torch.pow,
        aten.neg.default: torch.neg, aten.rsqrt.default: torch.rsqrt,
        aten.sqrt.default: torch.sqrt, aten.exp.default: torch.exp,
        aten.tanh.default: torch.tanh, aten.sigmoid.default: torch.sigmoid,
        aten.relu.default: torch.relu, aten.mean.dim: torch.mean,
        aten.sum.dim_IntList: torch.sum, aten.cat.default: torch.cat,
        aten.transpose.int: torch.transpose, aten.unsqueeze.default: torch.unsqueeze,
        aten.reshape.default: torch.reshape, aten.permute.default: torch.permute,
        aten.matmul.default: torch.matmul, aten.bmm.default: torch.bmm,
        aten.softmax.int: torch.softmax, aten.dropout.default: torch.dropout,
        aten.conv2d.default: torch.conv2d,
    }
    methods = {aten.view.default: "view", aten.to.dtype: "to",
               aten.contiguous.default: "contiguous", aten.expand.default: "expand"}
    return {**functions, **methods}


def fast_call(target: Any, args: tuple) -> Any:
    """What the generated code of a graph calls for ``target``, an aten op of an exported
    graph, given positional ``args``: ``(callable, args)`` with its Python binding
    (``torch.mul`` for ``aten.mul.Tensor``; a Tensor method's name, ``"view"``, for a
    method), which dispatches that same op, without the op overload's Python ``__call__``
    and its boxed dispatch (about 1.3 us an op on a CPU), and ``args`` without the trailing
    ones that equal the schema's defaults (a binding may take those by keyword alone:
    ``Tensor.to``'s ``memory_format``); None for any other target, or where an argument
    left is one the binding takes by keyword alone (called as it is). The graph keeps the
    op itself.

    Args:
        target: a call_function node's target.
        args: its positional arguments.
    """
    if not _FAST:
        _FAST.update(_fast_table())
    call = _FAST.get(target) if isinstance(target, OpOverload) else None
    if call is None:
        return None
    schema = target._schema.arguments
    args = tuple(args)
    while args and len(args) <= len(schema) and schema[len(args) - 1].has_default_value() \
            and _same(args[-1], schema[len(args) - 1].default_value):
        args = args[:-1]
    if call == "to" and len(args) > 4:  # (memory_format: a keyword of Tensor.to alone)
        return None
    return call, args


def _same(value: Any, default: Any) -> bool:
    """Whether an argument's value is its schema default (of the same type: ``1`` is not
    ``True``)."""
    return value is default or (type(value) is type(default) and value == default)


class RuntimeTracer(fx.Tracer):
    """The tracer torch.fx re-traces a pickled Program's generated code with on load
    (``GraphModule._tracer_cls``): each of fxamp's own functions the code calls
    (``fan_out``, ``check_input_dtypes``, ``autocast_module``...) stays a call, as in the
    graph that was pickled, instead of being traced through (a function run on Proxies
    returns what it returns for a non-tensor: a fan-out vanished, and a module called
    under autocast became a plain call)."""

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        forward = getattr(type(root), "forward", None)
        for value in getattr(forward, "__globals__", {}).values():
            if inspect.isfunction(value) and value.__module__.startswith("fxamp."):
                self._autowrap_function_ids.add(id(value))
        return super().trace(root, concrete_args)


def input_guard_conditions(gm: fx.GraphModule) -> Optional[List[str]]:
    """The conditions torch.export's input guard (``gm._guards_fn``) asserts, as its
    messages spell them (``hidden_states.size()[1] == 32``, ``use_cache == False``); None
    where ``gm`` has no such guard or its code is not the generated form this reads (a
    function of ``torch._assert(condition, "Guard failed: <condition>")`` lines wrapped
    in ``torch._dynamo.dont_skip_tracing``: ``torch.export._unlift``).

    Args:
        gm: an unlifted exported graph module.
    """
    guard = getattr(gm, INPUT_GUARD, None)
    forward = getattr(guard, "__dict__", {}).get("forward")
    cells = getattr(forward, "__closure__", None) or ()
    inner = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
    code = getattr(inner[0] if len(inner) == 1 else forward, "__code__", None)
    if code is None or "_assert" not in code.co_names:
        return None
    prefix = "Guard failed: "
    return [c[len(prefix):] for c in code.co_consts
            if isinstance(c, str) and c.startswith(prefix)]


def node_erased(node: fx.Node) -> bool:
    """Whether ``node`` was erased from its graph (``Node._erased``; an erased node keeps
    its ``graph`` and ``users``, so nothing public tells).

    Args:
        node: any node, erased or not.

    Returns:
        True once ``graph.erase_node(node)`` has run.
    """
    return bool(node._erased)


def rename_node(node: fx.Node, name: str) -> None:
    """Give ``node`` the name ``name`` in its graph's namespace (``Graph._graph_namespace``),
    also when the name was reserved by a node erased before: fx's own renaming would add a
    suffix to it.

    Args:
        node: the node to rename.
        name: its new name, which no other node of the graph may hold.
    """
    node.name = name
    node.graph._graph_namespace._rename_object(node, name)


def foreach_copy_(dsts: list, srcs: list) -> None:
    """Copy each of ``srcs`` into the matching tensor of ``dsts`` in one fused call
    (``torch._foreach_copy_``; the lists hold tensors of one dtype and device)."""
    torch._foreach_copy_(dsts, srcs)


@contextlib.contextmanager
def eager_compiler_flags() -> Iterator[None]:
    """Within the block, ``torch.compiler.is_compiling()`` and ``is_exporting()`` answer
    False, as in eager (``torch.compiler._is_compiling_flag`` / ``_is_exporting_flag``,
    which torch.export sets for the whole process while it runs); both are put back on
    every exit path. Only for a call that reads no tensor (a library's decision of which
    path to take), made while fxamp exports; a torch without the flags changes nothing."""
    import torch.compiler as compiler

    names = ("_is_compiling_flag", "_is_exporting_flag")
    if not all(hasattr(compiler, name) for name in names):
        yield
        return
    saved = [getattr(compiler, name) for name in names]
    for name in names:
        setattr(compiler, name, False)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(compiler, name, value)


# -- patches applied while tracing ------------------------------------------------------
#
# torch.fx's symbolic tracer does not see context managers, custom autograd Functions or
# attribute writes, so while fxamp traces a model it replaces a few of torch's attributes
# (the table below). None is replaced at import. :func:`patched` installs a replacement
# for the duration of a block, holding fxamp's one process-wide re-entrant trace lock
# (:func:`tracing`: two rewrites serialize), and puts the original back on every exit
# path. Each replacement is thread-aware: only on the thread that holds the lock does it
# run fxamp's handler; on every other thread it calls the original unchanged, so other
# threads' autocast, no_grad, inference_mode, attribute writes, Functions and stderr are
# untouched while a rewrite runs.

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One attribute a trace replaces: ``owner()`` (looked up when applied) holds it as
    ``attribute``; ``kind`` is how it is called (``function``: a plain function or a
    method in a class's dict; ``classmethod``; ``stream``: a text stream)."""

    name: str
    owner: Callable[[], Any]
    attribute: str
    kind: str
    does: str


def _autocast_class() -> Any:
    import torch.amp.autocast_mode as autocast_mode

    return autocast_mode.autocast


def _fx_graph_module() -> Any:
    import torch.fx.graph as fx_graph

    return fx_graph


#: every attribute a trace replaces, by name (see the section comment above)
TRACE_PATCHES: Dict[str, Patch] = {p.name: p for p in (
    Patch("module_setattr", lambda: torch.nn.Module, "__setattr__", "function",
          "fx: a buffer assigned in forward becomes a write_buffer_ node; the source line "
          "of each attribute the forward sets is noted for the side-effect report"),
    Patch("function_apply", lambda: torch.autograd.Function, "apply", "classmethod",
          "fx: a custom autograd Function applied to Proxies is recorded as one call"),
    Patch("is_grad_enabled", lambda: torch, "is_grad_enabled", "function",
          "fx: the grad mode a no_grad / enable_grad region saves is a graph node"),
    Patch("set_grad_enabled", lambda: torch._C, "_set_grad_enabled", "function",
          "fx: a grad-mode switch (no_grad, enable_grad, set_grad_enabled) is a graph node"),
    Patch("autocast_enter", _autocast_class, "__enter__", "function",
          "fx: a model's own torch.autocast region is refused (RegionRefused)"),
    Patch("inference_mode_enter", lambda: torch.autograd.grad_mode.inference_mode,
          "__enter__", "function",
          "fx and export: a model's own torch.inference_mode region is refused"),
    Patch("format_target", _fx_graph_module, "_format_target", "function",
          "fx code generation spells a module name holding a quote or a backslash"),
    Patch("mha_fastpath", lambda: torch.backends.mha, "get_fastpath_enabled", "function",
          "eager recording runs: torch.nn's fused Transformer fast path (taken in eval "
          "without grad) is off, so the dtypes recorded are the regular path's, which the "
          "plan computes"),
    Patch("stderr", lambda: sys, "stderr", "stream",
          "export: what torch prints to stderr while fxamp exports is captured"),
    Patch("checkpoint_impl", lambda: torch.utils.checkpoint, "_checkpoint_impl", "function",
          "fx and export: a torch.utils.checkpoint call runs inline and its nodes are "
          "tagged as a region (frontends/checkpointing.py)"),
)}


class _TraceState:
    """The thread holding the trace lock, how deep, and each patch's handler stack."""

    def __init__(self) -> None:
        self.owner: Optional[int] = None
        self.depth = 0
        self.handlers: Dict[str, List[Callable]] = {name: [] for name in TRACE_PATCHES}
        self.originals: Dict[str, Any] = {}
        self.installed: Dict[str, Any] = {}


_TRACE_LOCK = threading.RLock()
_STATE = _TraceState()


def tracing_thread() -> bool:
    """Whether the calling thread holds fxamp's trace lock (is tracing)."""
    return _STATE.owner == threading.get_ident()


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Hold fxamp's process-wide, re-entrant trace lock for the block: the patches of
    :func:`patched` act on this thread only, and another thread's rewrite waits."""
    with _TRACE_LOCK:
        outer = _STATE.depth == 0
        if outer:
            _STATE.owner = threading.get_ident()
        _STATE.depth += 1
        try:
            yield
        finally:
            _STATE.depth -= 1
            if outer:
                _STATE.owner = None


def _fx_module_wrappers_off() -> None:
    """Put back torch's own ``nn.Module.__call__`` / ``__getattr__`` where torch.fx's
    symbolic tracer left its process-wide wrappers (``functools.wraps`` of the originals
    fx keeps as ``_orig_module_call`` / ``_orig_module_getattr``)."""
    import torch.fx._symbolic_trace as symbolic_trace

    for attribute, original in (("__call__", symbolic_trace._orig_module_call),
                                ("__getattr__", symbolic_trace._orig_module_getattr)):
        current = vars(torch.nn.Module).get(attribute)
        if current is not original and getattr(current, "__wrapped__", None) is original:
            setattr(torch.nn.Module, attribute, original)


def _after_fork_in_child() -> None:
    """Reset the trace state in a forked child (``os.register_at_fork``).

    A child has only the thread that forked. When another thread held the trace lock (a
    rewrite in flight), that thread is gone: the child gets a new, free lock, torch's own
    attributes back in place of the patches of :data:`TRACE_PATCHES` and of torch.fx's
    module wrappers, and empty handler stacks, so its own rewrites run (before, the first
    one waited forever for the inherited lock). When the forking thread itself holds the
    lock (a fork from inside a traced forward), nothing changes: the child's frames are
    that thread's and release what they hold as they return."""
    global _TRACE_LOCK
    me = threading.get_ident()
    if _STATE.owner == me:
        return
    in_flight = _STATE.owner is not None
    _TRACE_LOCK = threading.RLock()
    for name in list(_STATE.installed):
        owner, original, replacement = _STATE.installed.pop(name)
        attribute = TRACE_PATCHES[name].attribute
        if vars(owner).get(attribute) is replacement:
            setattr(owner, attribute, original)
    for stack in _STATE.handlers.values():
        stack.clear()
    _STATE.originals.clear()
    _STATE.owner, _STATE.depth = None, 0
    if in_flight:
        _fx_module_wrappers_off()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _run(name: str, level: int, args: tuple, kwargs: dict) -> Any:
    """The handler at ``level`` of ``name``'s stack, given the next one down (the
    original below the first) as its first argument."""
    original = _STATE.originals[name]
    if level < 0:
        return original(*args, **kwargs)
    handler = _STATE.handlers[name][level]

    def below(*a: Any, **k: Any) -> Any:
        return _run(name, level - 1, a, k)

    return handler(below, *args, **kwargs)


class _ThreadStream:
    """A text stream that sends the tracing thread's writes to its handler's buffer
    and every other thread's to the stream it replaced."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def _target(self) -> Any:
        stack = _STATE.handlers["stderr"]
        return stack[-1] if stack and tracing_thread() else self._real

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _replacement(patch: Patch, original: Any) -> Any:
    if patch.kind == "stream":
        return _ThreadStream(original)
    name = patch.name
    stack = _STATE.handlers[name]
    if patch.kind == "classmethod":  # (a classmethod, or a C classmethod_descriptor)
        def raw(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return original.__get__(None, cls)(*args, **kwargs)

        _STATE.originals[name] = raw

        def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
            if stack and _STATE.owner == threading.get_ident():
                return _run(name, len(stack) - 1, (cls,) + args, kwargs)
            return original.__get__(None, cls)(*args, **kwargs)

        return classmethod(apply)
    _STATE.originals[name] = original

    def call(*args: Any, **kwargs: Any) -> Any:
        if stack and _STATE.owner == threading.get_ident():
            return _run(name, len(stack) - 1, args, kwargs)
        return original(*args, **kwargs)

    call.__name__ = getattr(original, "__name__", name)
    call.__qualname__ = getattr(original, "__qualname__", name)
    call.__doc__ = getattr(original, "__doc__", None)
    return call


def _install(patch: Patch) -> None:
    owner = patch.owner()
    original = vars(owner)[patch.attribute]
    replacement = _replacement(patch, original)
    _STATE.installed[patch.name] = (owner, original, replacement)
    setattr(owner, patch.attribute, replacement)


def _uninstall(patch: Patch) -> None:
    owner, original, replacement = _STATE.installed.pop(patch.name)
    _STATE.originals.pop(patch.name, None)
    if vars(owner).get(patch.attribute) is replacement:
        setattr(owner, patch.attribute, original)
    else:  # something else replaced it meanwhile: leave its value (it wraps ours)
        _log.warning("%s.%s was replaced while fxamp traced; leaving the new value",
                     getattr(owner, "__name__", owner), patch.attribute)


@contextlib.contextmanager
def patched(name: str, handler: Any) -> Iterator[None]:
    """Within the block, on this thread, :data:`TRACE_PATCHES` entry ``name`` runs
    ``handler(original, *args, **kwargs)`` (``original``: the handler of an enclosing
    block, or torch's own); for ``stderr``, ``handler`` is the stream that gets this
    thread's writes. Holds the trace lock (:func:`tracing`); the first block installs the
    replacement, the last one out puts torch's original back, on every exit path."""
    patch = TRACE_PATCHES[name]
    with tracing():
        stack = _STATE.handlers[name]
        if not stack:
            _install(patch)
        stack.append(handler)
        try:
            yield
        finally:
            stack.pop()
            if not stack:
                _uninstall(patch)


def format_target(base: str, target: str) -> str:
    """``base.a.b`` for a dotted ``target``; components that are not identifiers are
    spelled ``getattr(base, "...")`` with a correctly escaped string literal (what
    ``torch.fx.graph._format_target`` writes, except that torch's own does not escape a
    ``"`` or a ``\\`` in a name)."""
    out = base
    for part in target.split("."):
        if part.isidentifier():
            out = f"{out}.{part}"
        elif '"' in part or "\\" in part or not part.isprintable():
            out = f"getattr({out}, {part!r})"
        else:
            out = f'getattr({out}, "{part}")'
    return out


def spelling_names() -> "contextlib.AbstractContextManager":
    """While fxamp traces, fx code generation on this thread spells every module name
    (:func:`format_target`)."""
    return patched("format_target", lambda original, base, target: format_target(base, target))


def _misspelt(part: str) -> bool:
    """A name component torch's ``_format_target`` writes as Python that does not read
    it back (a quote, a backslash, a non-printable character)."""
    return not part.isidentifier() and ('"' in part or "\\" in part or not part.isprintable())


class _SpellsNames:
    """A code generator mixin: module names torch cannot spell are written by
    :func:`format_target` (their nodes' targets are spelled with markers for torch's own
    generator, the markers replaced by string literals in the code it writes)."""

    def _gen_python_code(self, nodes: Any, root_module: str, namespace: Any,
                         **kwargs: Any) -> Any:
        renamed: List[tuple] = []
        literals: Dict[str, str] = {}
        for node in nodes:
            if node.op not in ("get_attr", "call_module") or not isinstance(node.target, str):
                continue
            parts = node.target.split(".")
            if not any(_misspelt(p) for p in parts):
                continue
            spelt = []
            for part in parts:
                if _misspelt(part):
                    marker = f"<fxamp-name-{len(literals)}>"
                    literals[f'"{marker}"'] = repr(part)
                    part = marker
                spelt.append(part)
            renamed.append((node, node.target))
            node.target = ".".join(spelt)
        try:
            code = super()._gen_python_code(  # type: ignore[misc]
                nodes, root_module, namespace, **kwargs)
        finally:
            for node, target in renamed:
                node.target = target
        for marker, literal in literals.items():
            code.src = code.src.replace(marker, literal)
        return code


_SPELLING: Dict[type, type] = {}


def _spelling(cls: type) -> type:
    if issubclass(cls, _SpellsNames):
        return cls
    if cls not in _SPELLING:
        _SPELLING[cls] = type(f"Spelling{cls.__name__}", (_SpellsNames, cls),
                              {"__module__": __name__})
    return _SPELLING[cls]


class SpellingTracer(RuntimeTracer):
    """The tracer torch re-traces an unpickled GraphModule's code with: its graph
    spells every module name (the pickle of a module :func:`spell_names` mended), and
    fxamp's run-time calls stay calls (:class:`RuntimeTracer`)."""

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        graph = super().trace(root, concrete_args)
        graph._codegen.__class__ = _spelling(type(graph._codegen))
        return graph


def spell_names(root: torch.nn.Module) -> int:
    """Give each GraphModule in ``root`` whose graph names a module torch's code generator
    cannot spell (``a"b``) a generator that can (``Graph._codegen``'s class), kept by
    ``recompile()``, ``copy.deepcopy`` and pickling (``_tracer_cls``). How many changed."""
    changed = 0
    for module in root.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        graph = module.graph
        if not any(n.op in ("get_attr", "call_module") and isinstance(n.target, str)
                   and any(_misspelt(p) for p in n.target.split("."))
                   for n in graph.nodes):
            continue
        graph._codegen.__class__ = _spelling(type(graph._codegen))
        graph._tracer_cls = SpellingTracer
        module._tracer_cls = SpellingTracer
        module.recompile()
        changed += 1
    return changed


def recompile(module: fx.GraphModule) -> Any:
    """``module.recompile()``, also for a GraphModule whose class derives from another
    GraphModule's class (the eager front end's per-instance classes). ``recompile`` gives a
    class without its own ``_wrapped_call`` one that calls ``super().__call__``: the base
    class's wrapped call, which reads the subclass's ``_wrapped_call`` again (a
    RecursionError); such a class gets ``nn.Module.__call__`` as its own call first.

    Args:
        module: the graph module whose graph changed.
    """
    cls = type(module)
    if "_wrapped_call" not in vars(cls) and "__call__" not in vars(cls) \
            and hasattr(cls, "_wrapped_call"):
        cls.__call__ = torch.nn.Module.__call__  # type: ignore[method-assign]
    return module.recompile()


# -- private names other modules use
# (kept in one block: names reached by the op vocabulary, the checkpoint front-end helper
# and the trainer; each wrapper says which private name it reads)


import torch.utils.checkpoint as _checkpoint  # noqa: E402

__all__ += ["op_schema", "overload_name", "checkpoint_impl",
            "found_inf_per_device", "BATCH_NORM_BASE", "INSTANCE_NORM_BASE", "CONV_BASE",
            "CONV_TRANSPOSE_BASE"]

#: the private base classes of torch's norms (``nn.modules.batchnorm._BatchNorm``: the
#: ``BatchNorm1d/2d/3d`` and their lazy and sync forms; ``instancenorm._InstanceNorm``)
BATCH_NORM_BASE: type = torch.nn.modules.batchnorm._BatchNorm
INSTANCE_NORM_BASE: type = torch.nn.modules.instancenorm._InstanceNorm
#: the private base classes of torch's convolutions (``nn.modules.conv._ConvNd``: every
#: ``Conv*d`` and ``ConvTranspose*d``; ``_ConvTransposeNd``: the transposed ones)
CONV_BASE: type = torch.nn.modules.conv._ConvNd
CONV_TRANSPOSE_BASE: type = torch.nn.modules.conv._ConvTransposeNd


def op_schema(op: Any) -> Any:
    """The ``FunctionSchema`` of an ATen overload (``OpOverload._schema``): its ``name``
    (``aten::sum``) and ``arguments``."""
    return op._schema


def overload_name(op: Any) -> str:
    """An ATen overload's overload name (``OpOverload._overloadname``: ``"default"``,
    ``"Tensor_Scalar"``)."""
    return op._overloadname


def checkpoint_impl() -> Any:
    """``torch.utils.checkpoint._checkpoint_impl`` (what ``checkpoint``, its decorator form
    and ``checkpoint_sequential`` all call), or None on a torch without it."""
    return getattr(_checkpoint, "_checkpoint_impl", None)


def found_inf_per_device(scaler: Any, optimizer: Any) -> Dict[Any, torch.Tensor]:
    """device -> the found-inf flag ``scaler`` recorded for ``optimizer`` in its last
    ``unscale_`` (``GradScaler._found_inf_per_device``; what ``GradScaler.step`` sums to
    decide whether to skip)."""
    return scaler._found_inf_per_device(optimizer)


__all__ += ["size_range"]


def size_range(size: Any) -> Optional[tuple]:
    """``(symbol, lower, upper)`` of a symbolic size of an exported graph's input: the
    sympy symbol the export gave it (``SymInt.node.expr``; two dims with the same one must
    be equal) and the range its shape environment allows (``shape_env.var_to_range``, what
    torch.export's ``range_constraints`` and its input guards hold; ``upper`` None when
    unbounded). None for an int, or a size that is not a plain symbol with a range."""
    node = getattr(size, "node", None) if isinstance(size, torch.SymInt) else None
    expr = getattr(node, "expr", None)
    env = getattr(node, "shape_env", None)
    if expr is None or env is None or not getattr(expr, "is_Symbol", False):
        return None
    bounds = env.var_to_range.get(expr)
    if bounds is None:
        return None

    def as_int(value: Any) -> Optional[int]:
        try:
            return int(value)
        except (TypeError, ValueError, OverflowError, AttributeError):
            return None  # (sympy's and torch's infinities)

    return expr, as_int(bounds.lower) or 0, as_int(bounds.upper)


__all__ += ["fsdp_param_dtype"]


def fsdp_param_dtype(module: Any) -> Optional[torch.dtype]:
    """The ``param_dtype`` of the ``MixedPrecisionPolicy`` FSDP2's ``fully_shard`` was given
    for ``module`` (``FSDPModule._get_fsdp_state()._mp_policy``): the dtype its parameters
    are all-gathered in for forward. None when it has none, or is not fully sharded."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    try:
        policy = get_state()._mp_policy
    except Exception:  # noqa: BLE001 - another torch's FSDP2 state: nothing to say
        return None
    return getattr(policy, "param_dtype", None)
