"""Small functions the rewritten graphs call (guarded casts, params swapped in, autocast
leaves) and the tests that recognise run-time calls (hooked modules, grad-mode switches)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

#: a module's hook dicts that run when it is called
CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
              "_backward_pre_hooks")
#: the grad-mode switch a graph region boundary calls (``torch.no_grad`` kept in a graph)
SET_GRAD = torch._C._set_grad_enabled


def has_call_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs any hook of its own."""
    return any(getattr(module, kind, None) for kind in CALL_HOOKS)


def is_grad_mode_node(node: fx.Node) -> bool:
    """A region boundary (``torch._C._set_grad_enabled``)."""
    return node.op == "call_function" and node.target is SET_GRAD


def eligible(value: Any) -> bool:
    """A tensor autocast would cast: floating point and not float64."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype != torch.float64)


def cast_tree(value: Any, dtype: torch.dtype) -> Any:
    """Cast every eligible tensor inside lists/tuples/dicts to ``dtype``; leave the rest."""
    return tree_map(lambda v: v.to(dtype) if eligible(v) and v.dtype != dtype else v, value)


def call_with_params(module: nn.Module, params: Dict[str, torch.Tensor], *args: Any,
                     **kwargs: Any) -> Any:
    """Call ``module`` with some of its parameters replaced (e.g. by their FP16 casts)."""
    return torch.func.functional_call(module, params, args, kwargs, strict=False)


def device_type(args: Any) -> str:
    """The device type of the first tensor in ``args`` ("cpu" when there is none)."""
    leaves, _ = tree_flatten(args)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


@contextlib.contextmanager
def device_autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)``; for "cuda" without a GPU (fake CUDA tensors)
    the thread-local flags are set by hand — the AutocastCUDA kernels run on fake tensors
    all the same; for devices autocast does not know (``meta``) nothing is changed."""
    if device_type == "cuda" and not torch.cuda.is_available():
        saved = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        torch.set_autocast_dtype("cuda", dtype)
        torch.set_autocast_enabled("cuda", True)
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled("cuda", saved[0])
            torch.set_autocast_dtype("cuda", saved[1])
    elif torch.amp.is_autocast_available(device_type):
        with torch.autocast(device_type, dtype=dtype):
            yield
    else:
        yield


def autocast_wrapper(fn: Callable, dtype: torch.dtype, label: str) -> Callable:
    """A function that calls ``fn`` under ``torch.autocast`` of its inputs' device.

    Used for calls fxamp cannot see into (custom Functions, fx.wrap'ed functions, composite
    torch.nn modules): autocast decides inside them at run time (``rule="runtime"``).
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        with device_autocast(device_type((args, kwargs)), dtype):
            return fn(*args, **kwargs)

    safe = "".join(c if c.isalnum() else "_" for c in label)
    call.__name__ = f"autocast_{safe}"
    call.__qualname__ = call.__name__
    call.__module__ = __name__
    return call


def autocast_module(module: nn.Module, dtype_name: str, *args: Any, **kwargs: Any) -> Any:
    """Call a leaf module under ``torch.autocast`` of its inputs' device (``rule="runtime"``)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    with device_autocast(device_type((args, kwargs)), dtype):
        return module(*args, **kwargs)
