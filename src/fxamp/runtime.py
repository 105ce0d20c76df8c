"""Small functions the rewritten graphs call (guarded casts, params swapped in, autocast
leaves; what runs around every call is :mod:`fxamp.program`) and the tests that recognise
run-time calls (hooked modules, grad-mode switches)."""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from ._torch import SET_GRAD as _SET_GRAD, functorch_active, tree_flatten, tree_map
from .errors import InputDtypeError

#: a module's hook dicts that run when it is called
CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
              "_backward_pre_hooks")
#: those and their per-hook flags (by hook id): always-called, with-kwargs
CALL_HOOK_DICTS = CALL_HOOKS + ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                                "_forward_pre_hooks_with_kwargs")
#: the grad-mode switch a graph region boundary calls (``torch.no_grad`` kept in a graph)
SET_GRAD = _SET_GRAD

log = logging.getLogger(__name__)
class _Own(threading.local):
    """Per thread: ``depth``, fxamp's own autocast regions entered on this thread (a plain
    attribute: the per-call check reads it without a function call)."""

    depth = 0


#: fxamp's own autocast regions on this thread (``OWN.depth``; see :func:`device_autocast`)
OWN = _Own()
_OWN = OWN


def own_autocast_depth() -> int:
    """How many of fxamp's own autocast regions (:func:`device_autocast`: an eager root, a
    call kept under autocast) this thread is inside."""
    return _OWN.depth


def write_buffer_(buffer: torch.Tensor, value: Any) -> torch.Tensor:
    """A buffer assigned in ``forward`` (``self.steps = self.steps + 1``): ``value`` written
    into ``buffer``, which must keep its shape and dtype (the graph cannot rebind it)."""
    from .errors import UnsupportedModelError

    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=buffer.dtype, device=buffer.device)
    if value.shape != buffer.shape or value.dtype != buffer.dtype:
        raise UnsupportedModelError(
            f"forward assigns a buffer of shape {tuple(buffer.shape)} and dtype "
            f"{buffer.dtype} a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; "
            "the rewritten graph writes assigned buffers in place, so it cannot change their "
            "shape or dtype; what to do: keep the buffer's shape and dtype "
            "(.to(buffer.dtype)), or keep that value in a plain attribute outside forward")
    return buffer.copy_(value)


class _FanOut(torch.autograd.Function):
    """Forward: the shared cast of ``source`` (an alias, no copy). Backward: this consumer's
    gradient cast to ``source``'s dtype, so the consumers' gradients are summed at
    ``source`` in its dtype, as under autocast, which casts per op. Forward-mode AD: the
    tangent of ``shared`` (the cast of ``source``'s tangent, as each per-op cast has).
    The form ``torch.func`` takes (``forward`` without ``ctx``, a generated vmap rule);
    outside its transforms each consumer casts for itself (:func:`fan_out`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(source: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return shared.view_as(shared)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[torch.Tensor, torch.Tensor],
                      output: torch.Tensor) -> None:
        ctx.dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None

    @staticmethod
    def jvp(ctx: Any, source_tangent: Any, shared_tangent: Any) -> Any:
        return None if shared_tangent is None else shared_tangent.view_as(shared_tangent)


def _per_consumer(source: Any) -> bool:
    """Whether each consumer of a cast of ``source`` casts it for itself: ``source`` is a
    non-leaf tensor that autograd tracks, outside ``torch.func`` transforms."""
    return (torch.is_grad_enabled() and isinstance(source, torch.Tensor)
            and source.requires_grad and not source.is_leaf and not functorch_active())


def shared_cast(source: Any, dtype: torch.dtype) -> Any:
    """The cast of ``source`` to ``dtype`` that its consumers' :func:`fan_out` share, in
    the generated code of a graph where it has no other user; None where each consumer
    casts for itself (:func:`fan_out`), so a training step casts exactly as often as
    autocast, and a forward without grad once."""
    return None if _per_consumer(source) else source.to(dtype)


def fan_out(source: Any, dtype: torch.dtype, shared: Any, flat_linear: bool = False) -> Any:
    """One consumer's use of ``shared`` (``source`` cast to ``dtype`` once for several
    consumers). Without grad, or for a leaf (an input, a reentrant checkpoint's recomputed
    input, which autocast's cast cache shares too): ``shared`` itself. Where autograd
    tracks ``source``: the consumer's own cast, as autocast casts per op, so training sums
    the consumers' gradients at ``source`` in its dtype, bit for bit (``shared`` is None
    there where :func:`shared_cast` made it). Under ``torch.func``: ``shared`` with a
    backward of its own (:class:`_FanOut`), and a consumer that is a linear with a bias
    (``flat_linear``) gets its own backward for a contiguous 3-D leaf as well: torch.func
    runs such a linear on a flattened view of the input, which autocast casts per op, not
    from its cache."""
    if shared is None:
        return source.to(dtype)
    if not (torch.is_grad_enabled() and isinstance(source, torch.Tensor)
            and source.requires_grad and isinstance(shared, torch.Tensor)):
        return shared
    if not functorch_active():
        return shared if source.is_leaf else source.to(dtype)
    if source.is_leaf and not (flat_linear and source.dim() == 3 and source.is_contiguous()):
        return shared
    return _FanOut.apply(source, shared)


def check_input_dtypes(values: Tuple[Any, ...], planned: Tuple[torch.dtype, ...],
                       names: Tuple[str, ...]) -> None:
    """Refuse a floating input the plan does not hold for: one autocast treats otherwise
    than the example's dtype (the plan's casts would convert it, or values computed from
    it, where the FP32 model and autocast compute with it as it is, or raise). The graph
    calls it on every call, right after its placeholders (``passes/casts.py``), not only
    on the first.

    Autocast casts float16, bfloat16 and float32 tensors alike and leaves every other dtype
    as it is, so an input of one of those three may stand for another; an integer, bool,
    complex or float64 tensor where the example had one of them is refused, and so is any
    other dtype where the example had a float64 tensor.

    Args:
        values: the graph's floating inputs on this call (non-tensors are skipped).
        planned: the dtype each had in the example.
        names: their argument names, for the message.

    Raises:
        InputDtypeError: naming the first input refused and what to do.
    """
    for value, want, name in zip(values, planned, names):
        if not isinstance(value, torch.Tensor) or value.dtype == want or (
                want != torch.float64 and eligible(value)):
            continue
        if want == torch.float64:
            raise InputDtypeError(
                f"input {name!r} is a {value.dtype} tensor; the rewrite was planned for a "
                f"{want} input here, which torch.autocast leaves as it is, so the plan has "
                f"no cast where autocast would cast a {value.dtype} tensor or values "
                f"computed from it (autocast casts only float16, bfloat16 and float32 "
                f"tensors). what to do: pass {name} as {want} ({name}.to({want})), or "
                f"rewrite with example inputs of the dtypes you call with")
        raise InputDtypeError(
            f"input {name!r} is a {value.dtype} tensor; the rewrite was planned for a {want} "
            f"input here and its casts would convert it or the values computed from it, "
            f"where the FP32 model and torch.autocast compute with a {value.dtype} tensor "
            f"as it is, or raise (autocast casts only float16, bfloat16 and float32 "
            f"tensors). what to do: pass {name} as {want} ({name}.to({want})), or rewrite "
            f"with example inputs of the dtypes you call with")


_RANGE_WARNED: set = set()


def range_guard(value: Any, limit: float, name: str, seen: float, graph: int) -> None:
    """The policy ``guard=on``: after node ``name`` (planned low precision because its values
    stayed under ``limit`` on the calibration inputs, largest ``seen``), warn when a call's
    value passes ``limit`` (an inf or NaN too): once per rewritten graph (``graph``: its
    token), naming the first node past its limit."""
    if graph in _RANGE_WARNED or not isinstance(value, torch.Tensor) or \
            not value.is_floating_point() or value.numel() == 0:
        return
    peak = float(value.detach().abs().amax())
    if peak <= limit:
        return
    _RANGE_WARNED.add(graph)
    log.warning("node %s reached %.4g on this call, past %.4g, the limit its calibration "
                "range (largest %.4g) stayed under when it was planned %s: its low-precision "
                "values may overflow; what to do: calibrate with inputs like these "
                "(calibration_data=...) and rewrite", name, peak, limit, seen, value.dtype)


def has_call_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs any hook of its own (its hook dicts are instance
    attributes: read without a Python call per dict, as block mode's glue asks on every
    call of a block)."""
    return any(map(vars(module).get, CALL_HOOKS))


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
    """Call ``module`` with some of its parameters replaced (e.g. by their FP16 casts).
    (``params`` copied: an fx Interpreter, as torch.export runs, passes an immutable dict,
    which ``functional_call`` would update.)"""
    return torch.func.functional_call(module, dict(params), args, kwargs, strict=False)


def first_device(module: Any, inputs: Any = None) -> Optional[str]:
    """The device type a module computes on: its first floating Parameter or buffer's, else
    the first tensor's in ``inputs`` (any nesting); None where there is neither.

    Args:
        module: an ``nn.Module`` (anything else has no tensors of its own).
        inputs: its call's arguments, or None.

    Returns:
        A device type ("cpu", "cuda", "meta"...), or None.
    """
    if isinstance(module, nn.Module):
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.is_floating_point():
                return tensor.device.type
    leaves, _ = tree_flatten(inputs)
    return next((leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)), None)


def device_type(args: Any) -> str:
    """The device type of the first tensor in ``args`` ("cpu" when there is none)."""
    if type(args) is tuple and len(args) == 2 and type(args[0]) is tuple \
            and type(args[1]) is dict:  # (a call's (args, kwargs): its first argument's,
        for first in (*args[0][:1], *args[1].values()):  # when a tensor, with no pytree)
            if isinstance(first, torch.Tensor):
                return first.device.type
            break
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
    _OWN.depth += 1
    try:
        with _device_autocast(device_type, dtype):
            yield
    finally:
        _OWN.depth -= 1


@contextlib.contextmanager
def _device_autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
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
    call.fxamp_wrapped = fn  # type: ignore[attr-defined]  # (an FP32 run calls it as is)
    call.__name__ = f"autocast_{safe}"
    call.__qualname__ = call.__name__
    call.__module__ = __name__
    return call


def autocast_module(module: nn.Module, dtype_name: str, *args: Any, **kwargs: Any) -> Any:
    """Call a leaf module under ``torch.autocast`` of its inputs' device (``rule="runtime"``)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    with device_autocast(device_type((args, kwargs)), dtype):
        return module(*args, **kwargs)


def region_call(module: nn.Module, dtype_name: str, *args: Any, **kwargs: Any) -> Any:
    """Call a region planned on its own (block mode's glue calling a block, which computes
    with its own graphs): a plain module call; where the region has call hooks of its own,
    the call under ``torch.autocast`` of its inputs' device, so the hooks compute as they
    do when the model's forward runs under autocast (the region's graph turns autocast off
    inside it)."""
    if not has_call_hooks(module):
        return module(*args, **kwargs)
    return autocast_module(module, dtype_name, *args, **kwargs)
