"""Low-precision weight copies kept across forwards for the policy ``weights=o2``.

By default (``weights=cast``) the rewritten graph casts each FP32 Parameter it computes with
in low precision with ``Tensor.to``, as autocast does, and keeps nothing between steps. With
``weights=o2`` (Apex O2 style: bf16/fp16 copies of the weights live between steps, updated
by the optimizer) the graph casts through ``cast_weight`` (one node per weight and dtype,
marked as a cast in the IR: ``ir.is_cast``) into a ``WeightCache`` (a submodule
``fxamp_weight_cache`` of the rewritten module, without parameters or buffers). The text
below is about that cache.

When a copy is fresh. Nothing can tell cheaply that a weight changed: a fused optimizer, a
write through ``.data`` or a sharded all-gather change the values without bumping the
Parameter's version counter. So:

- with an attached optimizer (``fxamp.train.attach_optimizer``), its step re-casts the copies
  of the weights it owns (``train/o2.py``) and forwards, with grad or without, reuse them
  while the Parameter is the same object with the same version counter, storage, dtype,
  device, shape and strides; another optimizer's step or a write through ``.data`` is not
  seen: ``fxamp.train.refresh_weights(gm)`` re-casts;
- without one, a forward with grad casts every weight it uses (a warning says so).

Gradients: a copy cast with grad mode on keeps a backward that is ``Tensor.to``'s (the
low-precision gradient cast to the master's dtype; ``ToCopyBackward`` / ``CopyBackwards``, or
``_CastBack`` for copies written without grad and for CPU weights of ``BIG`` bytes or
more); it saves no tensor. Gradients reach the FP32 master exactly as without the cache
(bit-identical, tested).

Without grad (eval forwards, ``weights=o2``'s optimizer step) every stale weight of the cache
is re-cast in one ``torch._foreach_copy_`` per dtype and device; with grad, one cast per
weight. A copy is overwritten in place only when nothing else holds it (tensor and storage
use counts: no autograd graph saved it, no view or caller kept it), so an autograd graph
still alive keeps the copies it saved; else the cast goes to a new tensor. On CPU the FP32
gradient of a weight linked by ``_CastBack`` is likewise written into the previous
step's gradient memory once no ``.grad`` holds it. Reusing memory matters on CPU, where a
fresh large tensor page-faults (measured: casting GPT-2-small's 124M weights into new tensors
~5x the time of casting into existing ones; training steps 147k page faults -> 100k).

Threads: the copies are filled under the cache's lock. A forward whose copy is fresh reads
it without the lock (one read of the slot, checked fresh, is what it serves); a stale one
(the first calls of a fresh module, made by several threads at once, or a changed weight)
takes the lock, checks again and fills. A fill sets a slot's copy only once it is written
(meanwhile the slot reads as stale, so a forward that needs it waits for the lock): no
thread serves a slot being filled, and each is cast once however many threads ask.

The cache steps aside (a plain ``param.to(dtype)``) whenever it cannot be sure of a tensor:
while tracing, exporting or compiling, under a dispatch / torch-function mode (fake tensors,
functionalization), for tensor subclasses, inference tensors and the meta device.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from . import _torch
from .runtime import fan_out

log = logging.getLogger(__name__)

#: CPU weights at least this large (bytes) are linked by ``_CastBack``, which keeps their
#: FP32 gradient memory between steps: a fresh tensor of that size often page-faults (glibc
#: mmaps it or trims the heap under it), worth one Python call per weight in backward;
#: smaller ones keep torch's C++ backward
BIG = 1 << 20
SUBMODULE = "fxamp_weight_cache"  # the submodule name in the rewritten GraphModule
_PLAIN = (torch.Tensor, nn.Parameter)


class _CastBack(torch.autograd.Function):
    """Forward: the cached low-precision copy. Backward: the gradient cast to the master's
    dtype (what ``Tensor.to``'s backward returns), on CPU written into the slot's FP32
    gradient buffer when nothing else holds it (no fresh allocation)."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, copy: torch.Tensor,
                slot: "_Slot") -> torch.Tensor:
        # a weak reference: the slot holds this output, whose graph node holds ctx
        ctx.master_dtype, ctx.slot = master.dtype, weakref.ref(slot)
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        slot = ctx.slot()
        if grad is None or slot is None:
            return (None if grad is None else grad.to(ctx.master_dtype)), None, None
        return slot.upcast(grad, ctx.master_dtype), None, None


def _exclusive(t: torch.Tensor) -> bool:
    """Whether nothing but the cache holds ``t`` or its memory (no autograd graph saved it,
    no view, no caller kept it): it may then be overwritten. Conservative: False when the
    counts cannot be read."""
    try:
        return _torch.tensor_use_count(t) == 1 and _torch.storage_use_count(t) == 2
    except Exception:  # noqa: BLE001 (a torch without these counters: never overwrite)
        return False


def _reusable(old: Optional[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> bool:
    """``old`` can take ``like`` cast to ``dtype`` in place (what ``like.to(dtype)`` would
    allocate: same shape, strides, device) and nothing else holds it."""
    return (old is not None and old.dtype == dtype and old.device == like.device
            and old.shape == like.shape and old.stride() == like.stride()
            and _exclusive(old))


def _key(p: torch.Tensor) -> tuple:
    return (id(p), p._version, p.data_ptr(), p.dtype, p.device, tuple(p.shape), p.stride())


def _allocated(p: torch.Tensor) -> bool:
    """Whether ``p``'s memory is there to be read (FSDP2 frees an unsharded Parameter's
    storage between all-gathers: ``resize_(0)``)."""
    return p.numel() == 0 or p.untyped_storage().nbytes() > 0


def _cacheable(p: Any) -> bool:
    if type(p) not in _PLAIN or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False  # (compiling before is_inference: dynamo cannot trace that)
    if p.device.type == "meta" or p.is_inference():
        return False
    if _torch.in_dispatch_or_function_mode():
        return False
    return not _torch.is_functorch_wrapped(p)


class _Slot:
    __slots__ = ("param", "dtype", "key", "copy", "grad_copy", "version", "new", "grad_buf",
                 "with_grad", "__weakref__")

    def __init__(self, dtype: torch.dtype) -> None:
        self.param: Optional[torch.Tensor] = None
        self.dtype = dtype
        self.key: Optional[tuple] = None
        self.copy: Optional[torch.Tensor] = None  # no autograd history
        self.grad_copy: Optional[torch.Tensor] = None  # the same values, linked to the master
        self.version = 0  # the copy's own version counter when it was made
        self.new = False  # cast by a refresh and not served yet (not counted as a hit)
        self.grad_buf: Optional[torch.Tensor] = None  # CPU: last FP32 gradient's memory
        self.with_grad = False  # cast by a forward with grad

    def fresh(self, reuse_grad_copy: bool) -> bool:
        """Whether the copy may serve again: the same Parameter, unchanged as far as its
        version counter and storage tell (the attached optimizer re-casts what it steps
        on); a copy cast with grad only when ``reuse_grad_copy`` (``weights=o2``)."""
        return self.usable(reuse_grad_copy) is not None

    def usable(self, reuse_grad_copy: bool) -> Optional[torch.Tensor]:
        """The copy, read once, when it may serve again (see ``fresh``); else None."""
        p, copy, key = self.param, self.copy, self.key
        if (p is not None and copy is not None and key == _key(p)
                and copy._version == self.version
                and (reuse_grad_copy or not self.with_grad)):
            return copy
        return None

    def upcast(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``grad.to(dtype)``; on CPU (where a fresh large tensor page-faults) written into
        the previous step's gradient memory when nothing holds it any more (the optimizer's
        ``zero_grad(set_to_none=True)`` dropped it), and returned as a new alias of it
        (``_alias``)."""
        if (grad.device.type != "cpu" or grad.dtype == dtype or torch.is_grad_enabled()
                or type(grad) is not torch.Tensor):
            return grad.to(dtype)  # (grad enabled: create_graph, keep the plain formula)
        buf = self.grad_buf
        self.grad_buf = None
        if _reusable(buf, grad, dtype) and not grad.is_inference():
            buf.copy_(grad)
            self.grad_buf = buf
            return _alias(buf)
        fresh = grad.to(dtype)
        if buf is not None and self._is_grad_memory(buf):
            # a micro-batch of gradient accumulation: .grad still holds the kept memory and
            # this gradient is added into it; the cast is a temporary
            self.grad_buf = buf
            return fresh
        self.grad_buf = fresh
        return _alias(fresh)

    def _is_grad_memory(self, buf: torch.Tensor) -> bool:
        param = self.param
        grad = param.grad if param is not None and param.is_leaf else None
        return grad is not None and grad.data_ptr() == buf.data_ptr()


def _alias(buf: torch.Tensor) -> torch.Tensor:
    """A tensor on ``buf``'s memory with its own TensorImpl and storage, which keeps ``buf``
    referenced while it lives. Autograd adds a tied weight's other gradients in place only
    into a tensor whose storage nobody else holds (else into a fresh one: on CPU a page-
    faulting allocation, 74 ms of GPT-2-small's 500 ms step), and AccumulateGrad keeps it as
    ``.grad``; ``buf`` becomes exclusive again once that ``.grad`` (and any alias of it) is
    gone. ``buf.detach()`` where DLPack cannot take it."""
    try:
        return torch.from_dlpack(buf)
    except Exception:  # noqa: BLE001 - a dtype or layout DLPack lacks: share the storage
        return buf.detach()


class WeightCache(nn.Module):
    """Low-precision copies of the weights of one rewritten graph (no parameters, no
    buffers: nothing in ``state_dict``; copies are dropped on deepcopy and pickling)."""

    def __init__(self) -> None:
        super().__init__()
        self.slots: List[_Slot] = []
        self.attached = False  # o2: an optimizer re-casts the copies (train/o2.py)
        self._warned = False
        self.hits = 0
        self.casts = 0  # weights cast (misses), counted for tests and benchmarks
        self.served = False  # a copy was served since the o2 step last re-cast (train/o2.py)
        self._lock = threading.Lock()  # held while copies are filled (see the module text)

    def add_slot(self, dtype: torch.dtype, param: Optional[torch.Tensor] = None) -> int:
        """A new slot for one weight (``param``, if known: the first forward then casts
        every weight in one operation) cast to ``dtype``; its index."""
        self.slots.append(_Slot(dtype))
        self.slots[-1].param = param
        return len(self.slots) - 1

    def clear(self) -> None:
        """Drop every copy (the next forward casts again)."""
        with self._lock:
            for slot in self.slots:
                slot.param = slot.key = slot.copy = slot.grad_copy = slot.grad_buf = None

    def nbytes(self) -> int:
        """Bytes held by the copies, and by the FP32 gradient buffers kept for reuse (CPU)
        that no ``.grad`` holds any more (each storage counted once)."""
        seen: Dict[int, int] = {}
        for slot in self.slots:
            held = [slot.copy]
            if slot.grad_buf is not None and _exclusive(slot.grad_buf):
                held.append(slot.grad_buf)
            for t in held:
                if t is not None:
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def refresh(self, only_stale: bool = True, owned: Optional[set] = None) -> int:
        """Re-cast the copies of every known weight that changed (all with
        ``only_stale=False``), and those of the weights whose ``id`` is in ``owned`` (an
        optimizer just stepped on them: a fused step bumps no version counter), one
        ``torch._foreach_copy_`` per dtype and device; a copy is overwritten in place only
        when nothing else holds it (no autograd graph saved it, no caller kept it), else
        written into a new tensor. A weight whose memory is freed (FSDP2 between forwards)
        is marked stale instead: the next forward casts it. The number of weights cast or
        marked."""
        with self._lock:
            return self._refresh(only_stale, owned)

    def _refresh(self, only_stale: bool = True, owned: Optional[set] = None) -> int:
        """``refresh``, with the lock held."""
        groups: Dict[tuple, List[_Slot]] = {}
        n = 0
        for slot in self.slots:
            p = slot.param
            if p is None or not _cacheable(p):
                continue
            if (only_stale and slot.fresh(True)
                    and (owned is None or id(p) not in owned)):
                continue
            if not _allocated(p):
                # its memory is freed (FSDP2 between all-gathers, which keep the version
                # counter and often the address): the next forward casts it
                slot.key = None
                n += 1
                continue
            groups.setdefault((slot.dtype, p.device), []).append(slot)
        marked = n
        # copies are normal tensors (usable in training) even when made under inference_mode;
        # inference_mode(False) turns grad mode on, so no_grad comes inside it
        with torch.inference_mode(False), torch.no_grad():
            for (dtype, device), group in groups.items():
                dsts = []
                for s in group:
                    old, s.copy, s.grad_copy = s.copy, None, None
                    # reuse the old copy's memory (a fresh large tensor page-faults on CPU);
                    # else let go of it first, so the allocator can hand its memory back
                    dsts.append(old if _reusable(old, s.param, dtype) else None)
                    del old
                dsts = [d if d is not None else torch.empty_like(s.param, dtype=dtype)
                        for d, s in zip(dsts, group)]
                _torch.foreach_copy_(dsts, [s.param for s in group])
                for s, dst in zip(group, dsts):
                    s.copy, s.key, s.version, s.new = dst, _key(s.param), dst._version, True
                    s.with_grad = False
                n += len(group)
        self.casts += n - marked
        return n

    def get(self, index: int, param: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """The low-precision copy of ``param`` for slot ``index``, cast if it changed (without
        grad: with every other changed weight, in one operation); ``grad``: a copy whose
        backward returns the gradient to ``param``. A fresh copy is served without the lock;
        a stale one is filled under it (``_fill``)."""
        slot = self.slots[index]
        self.served = True
        o2 = self.attached
        if slot.param is param and (o2 or not grad):
            copy = slot.usable(o2)
            out = copy if copy is None or not grad else slot.grad_copy
            if out is not None:
                if slot.new:
                    slot.new = False
                else:
                    self.hits += 1
                return out
        with self._lock:
            return self._fill(slot, param, grad, o2)

    def _fill(self, slot: _Slot, param: torch.Tensor, grad: bool, o2: bool) -> torch.Tensor:
        """``get`` for a copy that may be stale, with the lock held: checked again (another
        thread may have filled it meanwhile), cast if stale, and served."""
        if slot.param is not param:
            slot.param, slot.key, slot.grad_copy = param, None, None
        key = _key(param)
        if not slot.fresh(o2) or (grad and not o2):
            if (not self.attached and not self._warned and grad
                    and slot.copy is not None):
                self._warned = True
                log.warning("policy weights=o2 but no optimizer re-casts the weights: the "
                            "forward casts them; call fxamp.train.attach_optimizer(gm, "
                            "optimizer) so the optimizer step does")
            if not grad:
                self._refresh()
            else:
                self._cast_with_grad(slot, param, key)
        if slot.new:
            slot.new = False
        else:
            self.hits += 1
        if not grad:
            return slot.copy
        if slot.grad_copy is None:  # copy written without grad (o2 step, eval forward)
            slot.grad_copy = _CastBack.apply(param, slot.copy, slot)
        return slot.grad_copy

    def _cast_with_grad(self, slot: _Slot, param: torch.Tensor, key: tuple) -> None:
        """Cast one stale weight with grad mode on, into the old copy's memory when nothing
        else holds it. The copy's backward (``ToCopyBackward`` / ``CopyBackwards``, both
        ``grad.to(param.dtype)``; saving no tensor) serves the micro-batches of an
        accumulation window. CPU weights of ``BIG`` bytes or more go through ``_CastBack``,
        whose backward also reuses the FP32 gradient memory (one Python call per weight)."""
        old, slot.copy, slot.grad_copy = slot.copy, None, None
        dtype = slot.dtype
        reuse = _reusable(old, param, dtype)
        if param.device.type == "cpu" and param.numel() * param.element_size() >= BIG:
            with torch.no_grad():
                copy = old.copy_(param) if reuse else param.to(dtype)
            del old
            slot.copy, slot.grad_copy = copy, _CastBack.apply(param, copy, slot)
        elif reuse:
            alias = old.detach()  # a new tensor on the same memory, recording the copy
            alias.copy_(param)
            slot.copy, slot.grad_copy = old, alias
        else:
            del old  # (its memory can serve the new copy)
            slot.grad_copy = param.to(dtype)
            slot.copy = slot.grad_copy.detach()
        slot.key, slot.version, slot.new = key, slot.copy._version, True
        slot.with_grad = True
        self.casts += 1

    def __deepcopy__(self, memo: dict) -> "WeightCache":
        new = WeightCache()
        new.slots = [_Slot(s.dtype) for s in self.slots]
        new.training = self.training
        return new

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["slots"] = [_Slot(s.dtype) for s in self.slots]
        state["attached"] = False
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickling: the state, with a new lock (a lock is not pickled)."""
        super().__setstate__(state)
        self._lock = threading.Lock()


def cast_weight(param: Any, dtype: torch.dtype, cache: Optional[WeightCache] = None,
                index: int = -1) -> Any:
    """``param.to(dtype)``, served from ``cache`` while ``param`` is unchanged."""
    if cache is None or not _cacheable(param):
        return param.to(dtype)
    return cache.get(index, param, torch.is_grad_enabled() and param.requires_grad)


#: where an in-place rewrite keeps its rewritten module in the model's ``__dict__`` (the
#: one definition: ``rewriter/inplace.py`` reads it from here)
INPLACE_GRAPH = "_fxamp_rewritten"


def caches(gm: nn.Module) -> List[WeightCache]:
    """Every WeightCache inside ``gm`` (nested rewrites have their own); for a model rewritten
    in place, those of the rewritten module it computes with."""
    gm = gm.__dict__.get(INPLACE_GRAPH, gm)
    return [m for m in gm.modules() if isinstance(m, WeightCache)]


def weight_cache_bytes(gm: nn.Module) -> int:
    """Bytes of low-precision weight copies ``gm`` keeps between forwards.

    Args:
        gm: a module ``amp_rewrite`` returned, or a model it rewrote in place.

    Returns:
        The bytes of the cached copies; 0 with the policy ``weights=cast`` or before the
        first forward.
    """
    return sum(c.nbytes() for c in caches(gm))


def cast_node(graph: fx.Graph, cache_node: fx.Node, cache: WeightCache, param_node: fx.Node,
              dtype: torch.dtype, name: str, param: Optional[torch.Tensor] = None) -> fx.Node:
    """A graph node ``cast_weight(param, dtype, cache, slot)`` with a new slot."""
    index = cache.add_slot(dtype, param)
    return graph.create_node("call_function", cast_weight,
                             (param_node, dtype, cache_node, index), {}, name)


def is_cast_node(node: fx.Node) -> bool:
    """A cast node of a rewritten graph: ``x.to(dtype)``, a weight's ``cast_weight`` or a
    consumer's share of a cast (``runtime.fan_out``); each takes the value first and the
    dtype second."""
    return ((node.op == "call_method" and node.target == "to")
            or (node.op == "call_function" and node.target in (cast_weight, fan_out)))
