"""torch's private API, in one place: everything a torch upgrade can break.

fxamp needs a few of torch's names that are not public API (pytree flattening, fake-tensor
exceptions, ``TorchDispatchMode``, ``_reparametrize_module``, the raw grad-mode switch,
dispatcher and storage counters, the graph's code generator, ``OpOverload``, the fused
``_foreach_copy_``). Every module of fxamp reaches them
through this module, so a torch upgrade is checked (tests/test_torch_compat.py, also run on
the oldest supported torch with ``pytest -m floor``) and mended here alone.

What stays elsewhere: the op vocabulary (``fxamp.oplists``, ``fxamp.autocast_tables``,
``fxamp.ops``) keeps the op *spellings* a graph's targets have (``torch._C._nn.linear``,
``torch._VF.lstm``, ``aten.*`` overloads): they are data a node is matched against, not API
fxamp calls. Logger names (``torch._export``) and docstrings mentioning private names are
text, not uses.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.fx._pytree as _fx_pytree
import torch.utils._pytree as _pytree
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
    "OpOverloadPacket",
    "SET_GRAD", "IS_GRAD", "replaced_set_grad_enabled", "has_kernel_for_dispatch_key",
    "storage_use_count", "tensor_use_count", "in_dispatch_or_function_mode",
    "is_functorch_wrapped", "functorch_active", "graph_codegen", "foreach_copy_",
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
#: the spelling of torch's pytree registration, named in error advice
PYTREE_REGISTER = "torch.utils._pytree.register_pytree_node"

#: ``torch.nn.utils.stateless._reparametrize_module``: a context manager that runs a module
#: with some parameters/buffers swapped for given tensors (``tie_weights``, ``strict``)
reparametrize_module = _reparametrize_module

#: the raw grad-mode switch a graph calls at a kept ``torch.no_grad`` region's boundaries
SET_GRAD = torch._C._set_grad_enabled
#: the grad-mode query a traced region boundary records
IS_GRAD = torch._C.is_grad_enabled


@contextlib.contextmanager
def replaced_set_grad_enabled(fn: Callable[[Any], None]) -> Iterator[None]:
    """Within the block ``torch._C._set_grad_enabled`` (what ``torch.no_grad`` and friends
    call) is ``fn``; the original is restored after."""
    saved = torch._C._set_grad_enabled
    torch._C._set_grad_enabled = fn  # type: ignore[assignment]
    try:
        yield
    finally:
        torch._C._set_grad_enabled = saved  # type: ignore[assignment]


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


def foreach_copy_(dsts: list, srcs: list) -> None:
    """Copy each of ``srcs`` into the matching tensor of ``dsts`` in one fused call
    (``torch._foreach_copy_``; the lists hold tensors of one dtype and device)."""
    torch._foreach_copy_(dsts, srcs)
