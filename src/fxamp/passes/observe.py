"""Autocast as the oracle: run one call under real ``torch.autocast`` and watch what it does.

The call runs on fake tensors of the *target* device (CPU autocast for ``target="cpu"``,
CUDA autocast on fake CUDA tensors for ``target="cuda"`` — no GPU needed), whatever device
the model itself is on. A ``TorchDispatchMode`` sits below autocast and sees the
``_to_copy`` casts autocast inserts on the call's floating inputs and weights; the call's
output dtypes are read off the result. Nothing real is computed and nothing of the model is
touched: every tensor is a fresh fake copy.

This holds for any op with an autocast kernel — every spelling of it (``torch.*``,
``torch._C._nn.*``, ``torch._VF.*``, ``F.*``, Tensor methods, modules), third-party ops
registered with autocast — and for whichever torch is installed.
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from .._torch import TorchDispatchMode, tree_flatten, tree_map

from ..graph_run import own_copies
from ..runtime import device_autocast

_TO_COPY = torch.ops.aten._to_copy.default
log = logging.getLogger(__name__)


class Observation:
    """What autocast did with one call: the dtypes it cast floating inputs to (``casts``:
    input index -> dtype), the floating output dtypes (None: unknown, the op has no fake
    kernel), and whether it refused the call."""

    __slots__ = ("casts", "inside", "outputs", "banned", "message")

    def __init__(self, casts: Dict[int, torch.dtype], outputs: Optional[Tuple[torch.dtype, ...]],
                 banned: bool = False, message: str = "", inside: bool = False) -> None:
        self.casts, self.outputs, self.banned, self.message = casts, outputs, banned, message
        self.inside = inside  # autocast also cast values made inside the call

    @property
    def cast_dtype(self) -> Optional[torch.dtype]:
        """The one dtype autocast cast the inputs to (the widest if several), or None."""
        return widest(list(self.casts.values()))


_Event = Tuple[Optional[int], torch.dtype, torch.dtype, Tuple[int, ...]]


class _CastRecorder(TorchDispatchMode):
    """Records every dtype-changing ``_to_copy``: (input index or None for a value made
    inside the call, from, to, shape). A view of an input counts as that input."""

    def __init__(self, watched: Dict[int, int]) -> None:
        super().__init__()
        self.watched = watched
        self.events: List[_Event] = []

    @classmethod
    def watching(cls, call_args: tuple) -> "_CastRecorder":
        """A recorder watching the floating inputs of ``(args, kwargs, params, buffers)``."""
        args, kwargs, params, _ = call_args
        return cls({id(t): i for i, t in enumerate(float_inputs(args, kwargs, params))})

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        dtype = kwargs.get("dtype")
        if (func is _TO_COPY and args and dtype is not None and args[0].is_floating_point()
                and dtype != args[0].dtype):
            source = args[0]
            if id(source) not in self.watched and source._base is not None:
                source = source._base  # a view of an input: the same cast, taken later
            self.events.append((self.watched.get(id(source)), args[0].dtype, dtype,
                                tuple(args[0].shape)))
        return func(*args, **kwargs)




def on_device(value: Any, device: torch.device, memo: Optional[Dict[int, Any]] = None) -> Any:
    """Fresh (fake, under a FakeTensorMode) tensors on ``device`` with the shapes, strides and
    dtypes of the tensors in ``value``; the same tensor twice maps to the same copy."""
    memo = {} if memo is None else memo

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if t.requires_grad:
                copy.requires_grad_(True)
            memo[id(t)] = copy
        return memo[id(t)]

    return tree_map(move, value)


def device_of(value: Any) -> Optional[torch.device]:
    """The device of the first tensor in ``value``, or None."""
    leaves, _ = tree_flatten(value)
    return next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)


def float_inputs(args: tuple, kwargs: dict, params: Dict[str, torch.Tensor]
                 ) -> List[torch.Tensor]:
    """The floating tensors a call receives (arguments, then its module's parameters)."""
    leaves, _ = tree_flatten((args, kwargs, params))
    seen: Dict[int, torch.Tensor] = {}
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            seen.setdefault(id(t), t)
    return list(seen.values())


def widest(dtypes: List[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype all of ``dtypes`` promote to (None for none)."""
    if not dtypes:
        return None
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def float_dtypes(value: Any) -> Tuple[torch.dtype, ...]:
    """The dtypes of the floating tensors in ``value``, in order."""
    leaves, _ = tree_flatten(value)
    return tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor)
                 and t.is_floating_point())


def is_autocast_refusal(err: BaseException) -> bool:
    """Whether ``err`` is autocast refusing an op it bans (binary_cross_entropy)."""
    return isinstance(err, RuntimeError) and "unsafe to autocast" in str(err)


def observe(call: Callable[[tuple, dict, dict, dict], Any], args: tuple, kwargs: dict,
            params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor], target: str,
            dtype: torch.dtype) -> Observation:
    """Run ``call(args, kwargs, params, buffers)`` under autocast of ``target`` on fake copies
    of every tensor on ``target``'s device and report what autocast did to the floating
    tensors of ``(args, kwargs, params)`` (indexed in ``float_inputs`` order). Must run inside
    a ``FakeTensorMode``. Other exceptions propagate (the caller decides without autocast).

    The call also runs once without autocast: the casts a kernel makes by itself (the math
    attention path upcasting fp16 to fp32) happen in both runs and are not autocast's."""
    device = torch.device(target)
    # (each run on its own copies of the argument objects a call changes in place: a KV
    # cache's ``update`` observed here must not append to the cache the graph's run reads)
    copies = on_device((*own_copies((args, kwargs)), params, buffers), device, {})
    recorder = _CastRecorder.watching(copies)
    try:
        with device_autocast(target, dtype), recorder:
            result = call(*copies)
    except Exception as err:  # noqa: BLE001 - judged below
        if is_autocast_refusal(err):
            return Observation({}, (), banned=True, message=str(err).splitlines()[0])
        if not recorder.events:
            raise
        # the op's fake kernel is missing or broken (CUDA-only ops: cudnn_convolution,
        # the fused GRU cell): autocast cast its inputs before the kernel failed; what
        # it returns is unknown
        log.debug("fake kernel failed after autocast's casts", exc_info=True)
        return Observation({i: to for i, _, to, _ in recorder.events if i is not None},
                           None)
    events, own = recorder.events, []
    if events:  # (no cast under autocast: nothing to tell apart)
        plain = on_device((*own_copies((args, kwargs)), params, buffers), device, {})
        own_recorder = _CastRecorder.watching(plain)
        try:
            with own_recorder:
                call(*plain)
        except Exception:  # noqa: BLE001 - e.g. a kernel only autocast's dtypes have
            pass
        own = own_recorder.events
    for event in own:
        if event in events:
            events.remove(event)
    casts: Dict[int, torch.dtype] = {}
    for index, _, to, _ in events:
        if index is not None:
            casts.setdefault(index, to)
    inside = any(index is None for index, _, _, _ in events)
    return Observation(casts, float_dtypes(result), inside=inside)


def call_key(op: Any, call: tuple, setting: tuple) -> Optional[tuple]:
    """A hashable description of everything a call's observation depends on — ``op`` (the
    callable, or a module's type, configuration and mode), every argument in ``call``
    (tensors by dtype, shape, stride, device and which of them are the same tensor; other
    values by type and repr) and ``setting`` (target, dtype) — or None when some argument
    cannot be described."""
    leaves, spec = tree_flatten(call)
    first: Dict[int, int] = {}
    described: list = []
    try:
        for i, v in enumerate(leaves):
            if isinstance(v, torch.Tensor):
                described.append((first.setdefault(id(v), i), v.dtype, tuple(v.shape),
                                  v.stride(), v.device.type, v.requires_grad))
            else:
                described.append((type(v), repr(v)))
        key = (op, str(spec), tuple(described), setting)
        hash(key)
    except Exception:  # noqa: BLE001 - an argument without a usable repr or hash
        return None
    return key


class _Cache:
    """Observations by ``call_key`` (least recently used dropped past ``size``): a model's
    repeated blocks, the annotate runs of one rewrite and later rewrites observe once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: "collections.OrderedDict[tuple, Optional[Observation]]" = (
            collections.OrderedDict())

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def get(self, key: tuple) -> Optional[Observation]:
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: tuple, obs: Optional[Observation]) -> None:
        self.entries[key] = obs
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)


CACHE = _Cache(4096)


def planned_casts(values: List[torch.Tensor], dtype: Optional[torch.dtype],
                  eligible: Callable[[Any], bool]) -> Dict[int, torch.dtype]:
    """The casts a planned input dtype makes on ``values`` (index -> dtype)."""
    if dtype is None:
        return {}
    return {i: dtype for i, t in enumerate(values) if eligible(t) and t.dtype != dtype}
