"""Low-precision weight copies kept across forwards, re-cast only when a weight changed.

The rewritten graph casts each FP32 Parameter it computes with in low precision through
:func:`cast_weight` (one node per weight and dtype, marked as a cast in the IR:
``ir.is_cast``). With the policy ``weights=cached`` (the default) the cast is kept in a
:class:`WeightCache` (a submodule ``fxamp_weight_cache`` of the GraphModule, without parameters or buffers) and reused while the
Parameter is unchanged: same object, same version counter (bumped by every in-place change:
optimizer steps, ``load_state_dict``, ``copy_``), same storage, dtype, device, shape and
strides. So eval loops, repeated forwards and the micro-batches of a gradient-accumulation
window cast each weight once per optimizer step.

Gradients: with grad mode on, a stale weight is cast with ``Tensor.to`` itself and that
result (with its ``ToCopyBackward`` node, which saves no tensor) is reused by the next
forwards; a copy written without grad (``weights=o2``'s optimizer step, an eval forward) is
linked to its master by :class:`_CastBack`, whose backward is the same: the low-precision
gradient cast to the master's dtype. Gradients reach the FP32 master exactly as without the
cache.

When a weight is found stale, every stale weight of the cache is re-cast in one
``torch._foreach_copy_`` per dtype and device (one operation instead of one per weight). Copies are never written in place, so an autograd
graph still alive keeps the copies it saved.

The cache steps aside (a plain ``param.to(dtype)``) whenever it cannot be sure of a tensor:
while tracing, exporting or compiling, under a dispatch / torch-function mode (fake tensors,
functionalization), for tensor subclasses, inference tensors and the meta device.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

log = logging.getLogger(__name__)

ATTR = "fxamp_weight_cache"  # the submodule name in the rewritten GraphModule
_PLAIN = (torch.Tensor, nn.Parameter)


class _CastBack(torch.autograd.Function):
    """Forward: the cached low-precision copy. Backward: the gradient cast to the master's
    dtype (what ``Tensor.to``'s backward returns)."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        return (None if grad is None else grad.to(ctx.master_dtype)), None


def _key(p: torch.Tensor) -> tuple:
    return (id(p), p._version, p.data_ptr(), p.dtype, p.device, tuple(p.shape), p.stride())


def _cacheable(p: Any) -> bool:
    if type(p) not in _PLAIN or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False  # (compiling before is_inference: dynamo cannot trace that)
    if p.device.type == "meta" or p.is_inference():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(p)


class _Slot:
    __slots__ = ("param", "dtype", "key", "copy", "grad_copy", "version")

    def __init__(self, dtype: torch.dtype) -> None:
        self.param: Optional[torch.Tensor] = None
        self.dtype = dtype
        self.key: Optional[tuple] = None
        self.copy: Optional[torch.Tensor] = None  # no autograd history
        self.grad_copy: Optional[torch.Tensor] = None  # the same values, linked to the master
        self.version = 0  # the copy's own version counter when it was made


class WeightCache(nn.Module):
    """Low-precision copies of the weights of one rewritten graph (no parameters, no
    buffers: nothing in ``state_dict``; copies are dropped on deepcopy and pickling)."""

    def __init__(self, mode: str = "cached") -> None:
        super().__init__()
        self.slots: List[_Slot] = []
        self.mode = mode  # "cached" or "o2" (the policy's weights)
        self.attached = False  # o2: an optimizer re-casts the copies (train/o2.py)
        self._warned = False
        self.enabled = True
        self.hits = 0
        self.casts = 0  # weights cast (misses), counted for tests and benchmarks

    def add_slot(self, dtype: torch.dtype, param: Optional[torch.Tensor] = None) -> int:
        """A new slot for one weight (``param``, if known: the first forward then casts
        every weight in one operation) cast to ``dtype``; its index."""
        self.slots.append(_Slot(dtype))
        self.slots[-1].param = param
        return len(self.slots) - 1

    def clear(self) -> None:
        """Drop every copy (the next forward casts again)."""
        for slot in self.slots:
            slot.param = slot.key = slot.copy = slot.grad_copy = None

    def nbytes(self) -> int:
        """Bytes held by the copies (each storage counted once)."""
        seen: Dict[int, int] = {}
        for slot in self.slots:
            if slot.copy is not None:
                storage = slot.copy.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def refresh(self, only_stale: bool = True) -> int:
        """Re-cast the copies of every known weight that changed (all with
        ``only_stale=False``), one ``torch._foreach_copy_`` per dtype and device into new
        tensors (a copy an autograd graph saved is never overwritten); the number of
        weights cast."""
        groups: Dict[tuple, List[_Slot]] = {}
        for slot in self.slots:
            p = slot.param
            if p is None or not _cacheable(p):
                continue
            if only_stale and slot.key == _key(p):
                continue
            groups.setdefault((slot.dtype, p.device), []).append(slot)
        n = 0
        # copies are normal tensors (usable in training) even when made under inference_mode;
        # inference_mode(False) turns grad mode on, so no_grad comes inside it
        with torch.inference_mode(False), torch.no_grad():
            for (dtype, device), group in groups.items():
                # one new tensor per weight (what Tensor.to allocates; one flat buffer was
                # slower on CPU: a fresh large allocation page-faults on every step)
                for s in group:  # let go of the old copies first: their memory is reused
                    s.copy = s.grad_copy = None
                dsts = [torch.empty_like(s.param, dtype=dtype) for s in group]
                torch._foreach_copy_(dsts, [s.param for s in group])
                for s, dst in zip(group, dsts):
                    s.copy, s.key, s.version = dst, _key(s.param), dst._version
                n += len(group)
        self.casts += n
        return n

    def get(self, index: int, param: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """The low-precision copy of ``param`` for slot ``index``, cast if it changed;
        ``grad``: a copy whose backward returns the gradient to ``param``."""
        slot = self.slots[index]
        if slot.param is not param:
            slot.param, slot.key, slot.grad_copy = param, None, None
        key = _key(param)
        if slot.key == key and slot.copy is not None and slot.copy._version != slot.version:
            slot.key = None  # something changed the copy itself in place: cast again
        if slot.key == key:
            self.hits += 1
            if not grad:
                return slot.copy
            if slot.grad_copy is None:  # copy written under no_grad (o2 step, eval)
                slot.grad_copy = _CastBack.apply(param, slot.copy)
            return slot.grad_copy
        if (self.mode == "o2" and not self.attached and not self._warned and grad
                and slot.copy is not None):
            self._warned = True
            log.warning("policy weights=o2 but no optimizer re-casts the weights: the "
                        "forward casts them; call fxamp.train.attach_optimizer(gm, "
                        "optimizer) so the optimizer step does")
        if not grad:
            self.refresh()
            return slot.copy
        # with grad: Tensor.to itself (its ToCopyBackward node saves no tensor, so the
        # micro-batches of an accumulation window reuse it); one weight at a time
        slot.copy = slot.grad_copy = None
        slot.grad_copy = param.to(slot.dtype)
        slot.copy, slot.key = slot.grad_copy.detach(), key
        slot.version = slot.copy._version
        self.casts += 1
        return slot.grad_copy

    def __deepcopy__(self, memo: dict) -> "WeightCache":
        new = WeightCache(self.mode)
        new.slots = [_Slot(s.dtype) for s in self.slots]
        new.enabled = self.enabled
        new.training = self.training
        return new

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["slots"] = [_Slot(s.dtype) for s in self.slots]
        state["attached"] = False
        return state


def cast_weight(param: Any, dtype: torch.dtype, cache: Optional[WeightCache] = None,
                index: int = -1) -> Any:
    """``param.to(dtype)``, served from ``cache`` while ``param`` is unchanged."""
    if cache is None or not _cacheable(param) or not cache.enabled:
        return param.to(dtype)
    return cache.get(index, param, torch.is_grad_enabled() and param.requires_grad)


def caches(gm: nn.Module) -> List[WeightCache]:
    """Every WeightCache inside ``gm`` (nested rewrites have their own)."""
    return [m for m in gm.modules() if isinstance(m, WeightCache)]


def weight_cache_bytes(gm: nn.Module) -> int:
    """Bytes of low-precision weight copies ``gm`` keeps between forwards (0 with the policy
    ``weights=cast`` or before the first forward)."""
    return sum(c.nbytes() for c in caches(gm))


def cast_node(graph: fx.Graph, cache_node: fx.Node, cache: WeightCache, param_node: fx.Node,
              dtype: torch.dtype, name: str, param: Optional[torch.Tensor] = None) -> fx.Node:
    """A graph node ``cast_weight(param, dtype, cache, slot)`` with a new slot."""
    index = cache.add_slot(dtype, param)
    return graph.create_node("call_function", cast_weight,
                             (param_node, dtype, cache_node, index), {}, name)


def is_cast_node(node: fx.Node) -> bool:
    """A cast node of a rewritten graph: ``x.to(dtype)`` or a weight's ``cast_weight``
    (both take the value first and the dtype second)."""
    return ((node.op == "call_method" and node.target == "to")
            or (node.op == "call_function" and node.target is cast_weight))
