"""``amp_rewrite(model, ..., inplace=True)``: the user's model itself computes with the plan.

The rewritten module (``gm``) shares the model's Parameters, buffers and leaf modules. With
``inplace=True`` it is kept in the model's ``__dict__`` (not as a submodule: the model's
``state_dict`` keys, ``parameters()`` and ``named_modules()`` stay as they were) and the
model's ``forward`` becomes a call of it. The model stays the same object of the same
class, so its other methods (``generate``, ``save_pretrained``, ``config``), the wrappers
around it (PEFT, Lightning, accelerate, DDP) and its hooks keep working; its own hooks run
once, around the rewritten forward. The graph reads the model's own modules, Parameters,
buffers and training flags (``fxamp/structure.py``): ``model.train()`` / ``model.eval()``,
``model.to(device)``, ``load_state_dict(assign=True)`` and a Parameter set on a module reach
it with no per-call copy. A change of the model's structure after the rewrite (a submodule
replaced or deleted, a parametrization, a patched ``forward``, ``.double()``) is seen at the
next call, which plans the model again on its inputs (logged as a warning) and computes with
the new plan; a change fxamp refuses (``.half()``: FP32 master weights) raises naming it.
``fxamp.plan_of(model)`` and ``fxamp.config_of(model)`` read the plan and config;
``fxamp.rewritten(model)`` returns the rewritten module.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import operator
import os
import threading
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..errors import (CallStructureError, FxampError, InputShapeError, UnsupportedModelError,
                      shorten)
from ..frontends.aten import call_leaves, grown_dimensions, grown_dynamic_shapes
from ..frontends.common import fast_path_modules, in_output_dtype
from ..frontends.eager import MISSED, notes_misses
from ..frontends.hooks import ROOT_HOOKS
from ..frontends.shadow import Shadow
from ..program import call_key
from ..result import RESULT, Pending, has_result, result_of
from ..runtime import device_autocast, device_type
from ..structure import StructureChanged, mirrors
from ..weight_cache import INPLACE_GRAPH

log = logging.getLogger(__name__)

#: the result attributes the model gets too (plan_of, config_of read them)
RESULT_ATTRS = (RESULT,)


def _check_sharding(model: nn.Module, cls: type) -> None:
    """After ``fully_shard`` of the model's root (its class swapped): the root's hooks
    gather every parameter before the forward, which then computes with them; sharded
    submodules would gather theirs in hooks the rewritten graph never calls: refused."""
    sharded = [path for path, m in model.named_modules() if path and is_fully_sharded(m)]
    if is_fully_sharded(model) and not sharded:
        return
    raise UnsupportedModelError(
        f"{cls.__name__} became a {type(model).__name__} after its in-place rewrite"
        + (f", and fully_shard was applied to its submodules ({', '.join(sharded[:3])})"
           if sharded else " (a wrapper swapped its class)")
        + ": the one graph of the whole model (partition='flat') runs the submodules' ops "
        "without calling them, so their hooks never run. what to do: for FSDP2 per layer, "
        "rewrite in place with the default partition (amp_rewrite(model, config=..., "
        "inplace=True), with or without example inputs: each layer stays a module called "
        "as one, planned on its first call or on the example now), then fully_shard each "
        "layer and the root; or keep one graph and fully_shard(model) on the root alone "
        "(one FSDP2 group)")


#: the modules that got an in-place rewrite (their own forward an InplaceForward or a
#: BlocksRoot), to find the rewrites a module is a part of (a module knows no parent;
#: ``rewriter/overlap.py``)
_INSTALLED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_INSTALLED_LOCK = threading.Lock()


def register(model: nn.Module) -> None:
    """Record that ``model`` got an in-place rewrite (see :func:`installed`).

    Args:
        model: the module whose forward was replaced.
    """
    with _INSTALLED_LOCK:
        _INSTALLED.add(model)


#: every in-place forward alive (a forked child gives each a new lock)
_FORWARDS: "weakref.WeakSet[InplaceForward]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child: new locks (another thread may have held one at the fork), and a
    model that thread was planning put back as before its planning (the child plans it
    on its own call; no thread of the child would ever finish that plan)."""
    global _INSTALLED_LOCK
    _INSTALLED_LOCK = threading.Lock()
    for forward in list(_FORWARDS):
        forward.lock = threading.RLock()
        stash = forward.__dict__.get("stash")
        if stash is not None:
            forward.stash = None
            _put_back(forward.model, *stash)


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def installed() -> List[nn.Module]:
    """The modules that got an in-place rewrite and are alive (some may have been rewritten
    again since: check their forward).

    Returns:
        The modules.
    """
    with _INSTALLED_LOCK:
        return list(_INSTALLED)


_TRAINING = operator.attrgetter("training")
#: the planning methods behind ``torch.compiler.disable`` by name, made at the first rewrite
#: (not at import: ``torch.compiler.disable`` imports torch._dynamo)
_EAGER: Dict[str, Callable[..., Any]] = {}
_PLANNING = ("_first", "_replanned", "_variant", "_planned_run")
_COMPILING = torch.compiler.is_compiling


def _outside_compile(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run eagerly, never traced by torch.compile: a compiled region around the
    model (a per-layer ``layer.compile()``) makes its first call plan inside it."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: Any, *args: Any) -> Any:
        eager = _EAGER.get(name)
        if eager is None:
            eager = _eager_planning()[name]
        return eager(self, *args)

    run.plain = method  # type: ignore[attr-defined]
    return run


def _eager_planning() -> Dict[str, Callable[..., Any]]:
    """Fill ``_EAGER`` (once per process)."""
    if not _EAGER:
        for name in _PLANNING:
            _EAGER[name] = torch.compiler.disable(getattr(InplaceForward, name).plain)
    return _EAGER


#: the graphs one in-place forward plans for its calls (a mode, a call structure, the
#: dtypes of its floating inputs, a size or Python value a graph fixed) since its structure
#: last changed; past it, that module runs under torch.autocast (torch.compile's
#: ``cache_size_limit``, 8, then its fallback to eager)
LIMIT = 8
#: what a graph raises for a call it was not traced for (another call structure or Python
#: value, another size where it fixed one): a miss when ``err.program`` is that graph
MISSES = (CallStructureError, InputShapeError)


def missed(err: BaseException, gm: Any) -> bool:
    """Whether ``err`` is ``gm``'s own refusal of a call (not a nested module's error)."""
    return getattr(err, "program", None) is gm


def float_dtypes(args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The dtypes of a call's floating tensor arguments: a graph planned on a call holds
    for those alone (autocast would compute a bf16 and an fp32 input differently)."""
    return tuple(v.dtype for v in (*args, *kwargs.values())
                 if isinstance(v, torch.Tensor) and v.is_floating_point())


def variant_key(module: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The key of the graphs planned for a call of ``module``: its training mode, the
    call's structure and its floating inputs' dtypes."""
    return (module.training, call_key(args, kwargs), float_dtypes(args, kwargs))


def made_for(key: tuple, grown: int = 0) -> str:
    """What a graph planned for variant ``key`` (:func:`variant_key`) is for, as
    ``graphs_of`` lists it: the mode and the floating inputs' dtypes (and how many
    dimensions and ints are symbolic in it, ``grown``)."""
    symbolic = f", {grown} dimension(s) or int(s) symbolic" if grown else ""
    return (f"{'train' if key[0] else 'eval'} mode, floating inputs "
            f"{_dtype_names(key[2]) or 'none'}{symbolic}")


def _dtype_names(dtypes: tuple) -> str:
    """``float32, bfloat16``."""
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


#: plans an in-place rewritten model on a call: (model, args, kwargs, config, why) -> the new
#: rewritten module, not installed (set by the pipeline, which owns amp_rewrite); ``why`` is
#: None for a first call (of the model, a mode or a call structure), else the change that
#: made the model's plan stale
Planner = Callable[[nn.Module, tuple, dict, Any, Optional[str]], nn.Module]


class InplaceForward:
    """The model's ``forward`` after an in-place rewrite: the one run-time path of an
    in-place model (see the module docstring). It holds the model's graphs: the first one
    (``model.__dict__[INPLACE_GRAPH]``, what ``plan_of`` reads) and, by (training mode, call key),
    those planned since for a mode or a call structure the first one was not traced for.
    Each call runs the graph made for it:

    - without example inputs, the first call plans the model on its own arguments;
    - a call in a mode the graph was not traced for (its model traces differently in train
      and eval mode), or of another call structure (an argument or keyword present, absent
      or None, or a Python value the graph holds as a constant), is planned on that call
      and its graph kept for the next such call;
    - when the model's structure changed since (a submodule replaced, a parametrization, a
      patched forward), the model is planned again on this call and computes with it;
    - a call that torch.autocast runs through torch.nn's fused Transformer fast path (in
      eval without grad on the CPU, :meth:`_fast_path`) runs under autocast.

    Planning happens once, under the forward's lock: another thread's call waits for it and
    then computes with the new graph (never with the plain FP32 forward or a half-built
    one). The user's RNG is untouched by planning. Holds the model (deepcopy and pickling
    carry it to the copy through their memo)."""

    def __init__(self, model: nn.Module, names: Optional[FrozenSet[str]],
                 plan: Optional[Planner] = None, config: Any = None) -> None:
        self.model = model
        self.names = names  # the keyword arguments the model's forward takes (None: any)
        self.cls = type(model)
        self.plan = plan
        self.config = config
        self.variants: Dict[tuple, List[nn.Module]] = {}
        self.lock = threading.RLock()
        # a rewritten module without a structure check of its own (an eager root): its
        # modules take the training flags of the model's at the same paths when they change
        self.pairs: List[Tuple[nn.Module, nn.Module]] = []
        self.theirs: List[nn.Module] = []
        self.flags: tuple = ()
        self.mode: Optional[bool] = None  # the first graph's (None: it follows the mode)
        # graphs planned on calls: how many since the structure last changed (LIMIT), the
        # first call's argument leaves and the (leaf, dimension) pairs seen to change since
        # (planned symbolic), the first graph's floating input dtypes (None: not planned on
        # a call), the misses that made them, and why the module runs under autocast now
        self.count = 0
        self.seen: List[Any] = []
        self.grown: set = set()
        self.dtypes: Optional[tuple] = None
        self.misses: List[str] = []
        self.fallback: Optional[str] = None
        # a size an eager root's exported child refused on an earlier call (that child ran
        # under autocast then): the next call plans anew, the size symbolic
        self.stale: Optional[BaseException] = None
        self.replans_inner = True  # (False once such a plan failed: see _variant)
        self.made: List[str] = []  # (each graph planned on a call: what for, why; graphs_of)
        self.stash: Optional[tuple] = None  # (what planning took off the model meanwhile)
        # its plan computes modules that take torch.nn's fused fast path (fast_path_modules)
        self.fast = False
        _FORWARDS.add(self)
        _eager_planning()  # (before any compiled region can reach the planning methods)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("lock", None)
        state["stash"] = None  # (a copy is not being planned)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self.__dict__.setdefault("stash", None)
        self.__dict__.setdefault("fast", False)
        self.__dict__.setdefault("stale", None)
        self.__dict__.setdefault("replans_inner", True)
        _FORWARDS.add(self)
        register(self.model)  # (a copy of an in-place model)

    def __deepcopy__(self, memo: dict) -> "InplaceForward":
        new = InplaceForward.__new__(InplaceForward)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def put(self, gm: nn.Module) -> None:
        """Make ``gm`` the model's first graph (a new plan: the others are dropped)."""
        model = self.model
        for kind in ROOT_HOOKS:  # the root's hooks run on the model itself, not twice
            theirs = getattr(model, kind, None)
            mine = getattr(gm, kind, None)
            if mine is not None and mine is theirs:  # (a shallow copy of the model's)
                setattr(gm, kind, type(mine)())
            elif theirs and mine:
                for key in list(theirs):
                    mine.pop(key, None)
        notes_misses(gm)  # (its eager roots' children: a refused size is a miss, see _run)
        model.__dict__[INPLACE_GRAPH] = gm
        for attr in RESULT_ATTRS:
            if hasattr(gm, attr):
                model.__dict__[attr] = getattr(gm, attr)
        self.variants = {}
        result = result_of(gm) if has_result(gm) else None
        self.mode = result.mode if result is not None else None
        structure = result.structure if result is not None else None
        self.pairs = [] if structure is not None else [
            (mine, theirs) for _, mine, theirs in mirrors(gm, model)]
        self.theirs = [theirs for _, theirs in self.pairs]
        self.flags = tuple(map(_TRAINING, self.theirs))
        if result is not None and result.config is not None:
            self.config = result.config
        self.fast = result is not None and result.policy.target == "cpu" and bool(
            fast_path_modules(model, result.plan.nodes))
        try:  # what inspect.signature(model.forward) tells a caller (HF Trainer reads it)
            self.__signature__ = inspect.signature(gm.forward)
        except (TypeError, ValueError):
            pass
        model.__dict__["forward"] = self  # (last: see install)
        if structure is not None:
            structure.inplace = True  # (the model's flags are the graph's)
            structure.take()  # (the model as it is now: its forward the rewritten one)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if type(model) is not self.cls:
            _check_sharding(model, self.cls)
            self.cls = type(model)
        if self.names is not None and not self.names.issuperset(kwargs):
            unseen = sorted(set(kwargs) - self.names)
            raise FxampError(
                f"{type(model).__name__} was called with keyword arguments its forward "
                f"does not take: {', '.join(unseen)} ({self.cls.__name__}.forward takes "
                f"{', '.join(sorted(self.names)) or 'none'} by keyword); what to do: call "
                "it with the forward's own argument names")
        if self.theirs:
            flags = tuple(map(_TRAINING, self.theirs))
            if flags != self.flags:
                for mine, theirs in self.pairs:
                    mine.training = theirs.training
                self.flags = flags
        gm = model.__dict__.get(INPLACE_GRAPH)
        fresh = gm is None
        if fresh:  # (no example inputs: planned on the first call)
            if self.fallback is not None:
                return self._autocast(args, kwargs)
            if _COMPILING():  # (a compiled region: planned and run outside it, see below)
                return self._planned_run(None, args, kwargs, None)
            gm = self._first(args, kwargs)
            if gm is None:  # (it runs under autocast: see _first)
                return self._autocast(args, kwargs)
        try:
            return self._run(gm, args, kwargs)
        except StructureChanged as err:
            if not err.replan or self.plan is None:
                raise
            if _COMPILING():
                return self._planned_run(gm, args, kwargs, str(err))
            gm = self._replanned(gm, args, kwargs, str(err))
        except BaseException:
            if fresh:  # (a first call that fails keeps no plan: the next one plans anew)
                self._forget(gm)
            raise
        return self._run(gm, args, kwargs)

    @_outside_compile
    def _planned_run(self, stale: Optional[nn.Module], args: tuple, kwargs: Dict[str, Any],
                     why: Optional[str]) -> Any:
        """A call that plans, inside a region torch.compile traces (a per-layer
        ``layer.compile()``): planned and run eagerly, outside the trace (the compiled code
        would otherwise read the new graph's Parameters as constants: no gradients). The
        region's next call is traced again with the graph in place."""
        gm = self._first(args, kwargs) if stale is None else self._replanned(
            stale, args, kwargs, why or "")
        if gm is None:
            return self._autocast(args, kwargs)
        try:
            return self._run(gm, args, kwargs)
        except BaseException:
            if stale is None:
                self._forget(gm)
            raise

    def _run(self, gm: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """The call on the first graph, or on the one made for its mode, structure, input
        dtypes and sizes (planned on this call when none is)."""
        if self.fallback is not None or self.fast and self._fast_path(args, kwargs):
            return self._autocast(args, kwargs)
        if self.mode is not None and self.mode is not self.model.training:
            return self._variant(args, kwargs, None)
        if self.dtypes is not None and float_dtypes(args, kwargs) != self.dtypes:
            return self._variant(args, kwargs, None)
        if self.stale is not None:  # (see _missed_inside)
            miss, self.stale = self.stale, None
            return self._variant(args, kwargs, miss, gm, True)  # (inner)
        try:
            out = gm(*args, **kwargs)
        except MISSES as err:
            if self.plan is None or not missed(err, gm):
                raise
            return self._variant(args, kwargs, err, gm)
        state = gm.__dict__
        if MISSED in state and state[MISSED] is not None:  # (an eager root's note)
            self._missed_inside(gm, args, kwargs)
        return out

    def _missed_inside(self, gm: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
        """An exported child of ``gm`` (an eager root) refused this call by a size it fixed
        and ran as autocast runs it (``frontends/eager.py``): the call is done, its code run
        once. The sizes of this call that differ from the first call's are noted as grown,
        and the next call plans anew with them symbolic (a miss, as in :meth:`_variant`),
        from its own arguments: this call's argument objects (a KV cache) were changed by
        it."""
        miss, gm.__dict__[MISSED] = gm.__dict__[MISSED], None
        if self.plan is None or not self.replans_inner:
            return
        with self.lock:
            if self.seen:
                self.grown.update(grown_dimensions(self.seen, call_leaves(self.model, args,
                                                                          kwargs)))
            self.stale = miss

    def _fast_path(self, args: tuple, kwargs: Dict[str, Any]) -> bool:
        """Whether this call is one that torch.autocast runs through torch.nn's fused fast
        path for the modules the plan computes (:func:`.common.fast_path_modules`): in eval,
        without grad, on the CPU, with the fast path on. No plan reaches into that fused
        kernel, so the call runs as autocast runs it (``fast_path`` in the plan header)."""
        return (not self.model.training and not torch.is_grad_enabled()
                and torch.backends.mha.get_fastpath_enabled()
                and device_type((args, kwargs)) == "cpu")

    def _forget(self, gm: nn.Module) -> None:
        """Drop a graph whose first call failed (the call's error is the model's, or
        autocast's, as the FP32 model raises it; a plan made for it is kept nowhere)."""
        with self.lock:
            if self.model.__dict__.get(INPLACE_GRAPH) is gm:
                self.model.__dict__[INPLACE_GRAPH] = None
                self.model.__dict__[RESULT] = Pending(self.config, type(self.model).__name__)
                self.model.__dict__["forward"] = self
                self.dtypes, self.seen, self.count = None, [], 0
            self.variants = {k: [g for g in v if g is not gm]
                             for k, v in self.variants.items()}
            forget = getattr(self.plan, "forget", None)
            if forget is not None:
                forget(gm)

    @_outside_compile
    def _first(self, args: tuple, kwargs: Dict[str, Any]) -> nn.Module:
        """The model's first graph, planned on this call (once, whichever thread calls)."""
        with self.lock:
            gm = self.model.__dict__.get(INPLACE_GRAPH)
            enclosing = self.__dict__.get("enclosing")
            if gm is None and self.fallback is None and enclosing is not None:
                held = unregistered_parameters(self.model, enclosing)
                if held:  # (a graph would read their Parameters as constants: no grads)
                    self.fallback = f"it calls modules it does not register: {held}"
                    self.made = [f"runs under torch.autocast: {self.fallback}"]
                    log.warning(
                        "%s calls modules holding Parameters that it does not register "
                        "(%s): a graph of it would read those Parameters as constants and "
                        "they would get no gradient, so it runs under torch.autocast "
                        "(autocast's dtypes and gradients). what to do: register them "
                        "(an nn.ModuleList or an attribute instead of a plain list or "
                        "dict) and rewrite again", type(self.model).__name__, held)
            if gm is None and self.fallback is None:
                gm = self._planned(args, kwargs, None)
                self.put(gm)
                self.dtypes = float_dtypes(args, kwargs)
                self.made = [f"{self._made_for(args, kwargs)}: the first call"]
            return gm

    @_outside_compile
    def _replanned(self, stale: nn.Module, args: tuple, kwargs: Dict[str, Any],
                   why: str) -> nn.Module:
        """The model planned again on this call, unless another thread did it already."""
        with self.lock:
            gm = self.model.__dict__.get(INPLACE_GRAPH)
            if gm is stale or gm is None or any(stale in v for v in self.variants.values()):
                self.count, self.seen, self.grown, self.misses = 0, [], set(), []
                self.made = [f"{self._made_for(args, kwargs)}: planned again, {why}"]
                self.fallback = None  # (a new structure: planned anew, with a new bound)
                gm = self._planned(args, kwargs, why)
                self.put(gm)
                if self.dtypes is not None:
                    self.dtypes = float_dtypes(args, kwargs)
            return gm

    @_outside_compile
    def _variant(self, args: tuple, kwargs: Dict[str, Any], miss: Optional[BaseException],
                 first: Optional[nn.Module] = None, inner: bool = False) -> Any:
        """The call run on a graph made for its mode, call structure and floating input
        dtypes that takes it, planned on this call when none does: with every dimension and
        Python int seen to change since the first call symbolic (torch.compile's automatic
        dynamic). A new graph for a size or value ``first`` (the first graph) fixed
        replaces it, the old one kept last. Past ``LIMIT`` graphs, the module runs under
        torch.autocast from now on, with one warning naming it and what kept changing.

        ``inner``: the miss was an exported child's inside ``first`` (an eager root) on an
        earlier call, which that child ran as autocast runs it. Where this call cannot be
        planned (its argument objects hold what earlier calls computed in low precision,
        which the FP32 run of planning cannot take: a KV cache's bf16 keys), it runs on
        ``first``, its children running under autocast on the sizes they do not take,
        and such misses plan nothing more."""
        key = variant_key(self.model, args, kwargs)
        dtypes = key[2]
        for gm in self.variants.get(key, ()):
            try:
                return gm(*args, **kwargs)
            except MISSES as err:
                if not missed(err, gm):
                    raise
                miss = err
        if miss is None:
            miss_text = ("its input dtypes " + _dtype_names(dtypes)
                         if self.dtypes is not None and dtypes != self.dtypes
                         else f"{'train' if self.model.training else 'eval'} mode")
        else:
            miss_text = shorten(str(miss).split("\n", 1)[0], 160)
        with self.lock:
            if self.fallback is None and self.count >= LIMIT:
                self._give_up(miss_text)
            if self.fallback is None:
                if miss_text not in self.misses:
                    self.misses.append(miss_text)
                known = self.variants.get(key, [])
                try:
                    gm = self._planned(args, kwargs, None)
                except Exception as err:  # noqa: BLE001 - see the docstring
                    if not inner or first is None:
                        raise
                    self.replans_inner = False
                    log.info("%s: not planned again for a size its exported parts fixed "
                             "(%s: %s); they run under torch.autocast on the sizes they "
                             "do not take", type(self.model).__name__, type(err).__name__,
                             shorten(str(err).split("\n", 1)[0], 160))
                    self.made.append(f"{self._made_for(args, kwargs)}: not planned, its "
                                     f"parts run under torch.autocast on other sizes: "
                                     f"{miss_text}")
                    return first(*args, **kwargs)
                self.made.append(f"{self._made_for(args, kwargs)}: {miss_text}")
                grows = first is not None and (isinstance(miss, InputShapeError)
                                               or getattr(miss, "scalar", None) is not None)
                if grows and self.model.__dict__.get(INPLACE_GRAPH) is first:
                    variants = self.variants
                    self.put(gm)  # (the new first graph; the old one tried last)
                    self.variants = {**variants, key: [*known, first]}
                else:
                    self.variants = {**self.variants, key: [gm, *known]}
        if self.fallback is not None:
            return self._autocast(args, kwargs)
        try:
            return gm(*args, **kwargs)
        except BaseException:
            self._forget(gm)  # (a call that fails keeps no plan)
            raise

    def _made_for(self, args: tuple, kwargs: Dict[str, Any]) -> str:
        """What a graph planned on this call is for (:func:`made_for`)."""
        return made_for(variant_key(self.model, args, kwargs), len(self.grown))

    def _give_up(self, miss: str) -> None:
        """Stop planning: the module runs under torch.autocast from now on (one warning)."""
        name = type(self.model).__name__
        self.fallback = miss
        self.made.append(f"runs under torch.autocast from now on ({LIMIT} graphs): {miss}")
        changed = "; ".join([*self.misses[-4:], miss])
        log.warning(
            "%s: %d graphs were planned for its calls (the limit, as torch.compile's "
            "cache_size_limit), and this call needs another; it runs under torch.autocast "
            "from now on (autocast's dtypes for every op, so fxamp's numerics rules do not "
            "apply to it). What kept changing: %s. what to do: give it calls of fewer "
            "shapes, modes and Python values (pad to a few lengths; pass a changing number "
            "as a tensor), or rewrite it with example inputs and "
            "RewriteConfig.make(dynamic_shapes=...)", name, self.count, changed)

    def _autocast(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """The call run as torch.autocast runs it: the module's own forward under autocast
        of the plan's dtype, its outputs in the policy's output dtype."""
        model, policy = self.model, self.config.policy
        with device_autocast(device_type((args, kwargs)), policy.compute):
            out = type(model).forward(model, *args, **kwargs)
        return in_output_dtype(out, policy.output_dtype)

    def _planned(self, args: tuple, kwargs: Dict[str, Any], why: Optional[str]) -> nn.Module:
        """A graph of the model planned on this call (the caller holds the lock), with the
        dimensions and Python ints seen to change since the first call symbolic."""
        if self.plan is None or self.config is None:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} cannot be planned on this call: its rewrite "
                "kept no config. what to do: rewrite the model again")
        config = self.config
        with planning(self.model, self.lock, self):
            leaves = call_leaves(self.model, args, kwargs)
            if not self.seen:
                self.seen = leaves
            else:
                self.grown.update(grown_dimensions(self.seen, leaves))
            if self.grown:
                config = config.replace(dynamic_shapes=grown_dynamic_shapes(
                    self.model, args, kwargs, self.grown))
            gm = self.plan(self.model, args, kwargs, config, why)
        notes_misses(gm)
        self.count += 1
        return gm


def unregistered_parameters(model: nn.Module, enclosing: nn.Module,
                            limit: int = 3) -> List[str]:
    """Where ``model``'s modules hold, outside their registered children (in a plain list,
    tuple or dict), a module with Parameters that require grad and that ``enclosing`` (the
    whole model ``model`` is a block of) trains: ``"extra[0] (Linear)"``, at most
    ``limit``. (A module hidden from the whole model, a frozen teacher, is not named.)

    Args:
        model: the block about to be planned on its own.
        enclosing: the model it is a block of.
        limit: how many to name.
    """
    mine = {id(m) for m in model.modules()}
    trained: Set[int] = set()  # (the whole model's, read once a module outside is found:
    found: List[str] = []  # reading them for every block of a deep model costs O(depth))

    def walk(value: Any, where: str, depth: int) -> None:
        if len(found) >= limit or depth > 2:
            return
        if isinstance(value, nn.Module):
            held = [id(p) for p in value.parameters() if p.requires_grad]
            if id(value) in mine or not held:  # (HF's kernel functions hold none)
                return
            if not trained:
                trained.update(id(p) for p in enclosing.parameters() if p.requires_grad)
            if not trained.isdisjoint(held):
                found.append(f"{where} ({type(value).__name__})")
            return
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value[:64]):
                walk(item, f"{where}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in list(value.items())[:64]:
                walk(item, f"{where}[{key!r}]", depth + 1)

    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if name in ("_modules", "_parameters", "_buffers") or name.endswith("hooks"):
                continue
            if isinstance(value, (nn.Module, list, tuple, dict)):
                walk(value, f"{path}.{name}" if path else name, 0)
    return found


def graphs_of(model: nn.Module) -> Dict[str, List[str]]:
    """The graphs an in-place rewrite planned on the calls of ``model`` and its parts (the
    model itself, or each block and the glue in block mode), by module path (``""``: the
    model, or its glue): for
    each, what it was made for (the mode, the floating inputs' dtypes, how many dimensions
    and Python ints it takes as symbols) and why (the first call, or what the call before it
    missed: another size, value, dtype or mode); and whether the module runs under
    ``torch.autocast`` now, past the limit of graphs. The plan (``plan_of``) is the first
    graph's; these are the run-time facts beside it.

    Args:
        model: a model rewritten with ``amp_rewrite(..., inplace=True)``.

    Returns:
        ``{path: [one line per graph, in the order they were planned]}``, for the modules
        planned on a call so far.
    """
    found: Dict[str, List[str]] = {}
    for path, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, InplaceForward) and forward.made:
            found[path] = list(forward.made)
        glue = getattr(forward, "glue", None)  # (block mode's root: its glue, rewriter/glue.py)
        if getattr(glue, "made", None):
            found[path] = list(glue.made)
    return found


def planning_forward(model: nn.Module, lock: Any) -> Callable[..., Any]:
    """The model's ``forward`` while it is being planned: the planning thread runs the
    model's own forward (its code is what is traced); any other thread waits for the plan
    and then calls the model's forward again (never the plain FP32 forward).

    Args:
        model: the model being planned.
        lock: held by the planning thread until the plan is in place.

    Returns:
        The forward to set on the model's instance.
    """
    own = type(model).forward.__get__(model)
    owner = threading.get_ident()

    @functools.wraps(own)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == owner:
            return own(*args, **kwargs)
        with lock:  # (the plan is done once this is acquired)
            pass
        return model.forward(*args, **kwargs)

    forward.fxamp_planning = True  # type: ignore[attr-defined]  # (see check_own_forward)
    return forward


def check_own_forward(model: nn.Module) -> None:
    """Refuse an in-place rewrite of a model whose instance has a ``forward`` of its own
    (the rewrite replaces it), naming fxamp's own planning forward as what it is.

    Args:
        model: the model about to be rewritten in place.
    """
    forward = model.__dict__.get("forward")
    if forward is None:
        return
    if getattr(forward, "fxamp_planning", False):
        raise FxampError(
            f"{type(model).__name__} is being planned now, on a call in another thread (its "
            "in-place rewrite plans it on its calls); what to do: rewrite it again once "
            "that call returns, or rewrite it before any thread calls it")
    raise FxampError(
        f"{type(model).__name__} has a forward of its own set on the instance "
        f"({forward!r}); inplace=True replaces it. what to do: rewrite with inplace=False "
        "and use the returned module")


@contextlib.contextmanager
def planning(model: nn.Module, lock: Any, owner: Optional["InplaceForward"] = None
             ) -> Iterator[None]:
    """``model`` with its own forward back for the planning thread while it is planned on
    a call; other threads' calls wait for the plan (see ``planning_forward``). ``owner``
    (the model's in-place forward) holds what was taken meanwhile, so that a process forked
    now puts it back in the child (:func:`_after_fork_in_child`), which has no planning
    thread to wait for."""
    taken = take(model)
    earlier = taken.get(RESULT)
    model.__dict__[RESULT] = Pending(getattr(earlier, "config", None), type(model).__name__,
                                     planning=True)
    # (a module compiled on its own, ``layer.compile()``: planning traces its code, not
    # the compiled call, whose trace would read the Parameters as constants)
    compiled = [(m, m.__dict__["_compiled_call_impl"]) for m in model.modules()
                if m.__dict__.get("_compiled_call_impl") is not None]
    for m, _ in compiled:
        m.__dict__["_compiled_call_impl"] = None
    model.__dict__["forward"] = planning_forward(model, lock)
    if owner is not None:
        owner.stash = (taken, compiled)
    try:
        yield
    finally:
        _put_back(model, taken, compiled)
        if owner is not None:
            owner.stash = None


def _put_back(model: nn.Module, taken: Dict[str, Any], compiled: list) -> None:
    """Undo what :func:`planning` did to ``model``."""
    model.__dict__.pop("forward", None)
    model.__dict__.pop(RESULT, None)
    model.__dict__.update(taken)
    for m, call in compiled:
        m.__dict__["_compiled_call_impl"] = call


def _keywords(forward: Callable[..., Any]) -> Optional[FrozenSet[str]]:
    """The names ``forward`` takes as keywords (None when it takes any). The model's own:
    the rewritten module checks a call's structure against its example itself."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def install(model: nn.Module, gm: Optional[nn.Module], plan: Optional[Planner] = None,
            config: Any = None) -> nn.Module:
    """Make ``model`` compute with ``gm`` (see the module docstring); returns ``model``.

    Args:
        model: the user's model.
        gm: its rewritten module; None: the model is planned on its first call.
        plan: what plans the model on a call (a first call, a new mode or call structure,
            a structure change).
        config: the config to plan with when ``gm`` is None.
    """
    check_own_forward(model)
    forward = InplaceForward(model, _keywords(model.forward), plan, config)
    if gm is None:
        model.__dict__[INPLACE_GRAPH] = None
        model.__dict__[RESULT] = Pending(config, type(model).__name__)
        try:
            forward.__signature__ = inspect.signature(  # type: ignore[attr-defined]
                type(model).forward.__get__(model))
        except (TypeError, ValueError):
            pass
        model.__dict__["forward"] = forward
    else:  # (the forward is set last: another thread's call runs the FP32 forward until
        forward.put(gm)  # then, never an in-place forward without its graph)
    register(model)
    return model


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``module`` (it swaps in a class that
    derives from ``FSDPModule``)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "FSDPModule" and cls.__module__.startswith("torch.distributed"):
            return True
    return False


def take(model: nn.Module) -> Dict[str, Any]:
    """Take ``model``'s in-place rewrite off (its own forward back); returns what was taken.

    Args:
        model: a model rewritten in place.
    """
    keys = (INPLACE_GRAPH, "forward") + RESULT_ATTRS
    return {k: model.__dict__.pop(k) for k in keys if k in model.__dict__}


def uninstalled(model: nn.Module) -> Shadow:
    """A shadow of ``model`` (``frontends/shadow.py``) whose root has its own forward back,
    for another rewrite of it (healing, the search, a new policy): the model itself keeps
    its in-place rewrite, so other threads' calls compute with it until the new one is
    installed. The caller releases the shadow (``Shadow.release``) when done."""
    shadow = Shadow(model)
    take(shadow.root)
    return shadow


def reinstall(model: nn.Module, gm: nn.Module, plan: Optional[Planner] = None) -> nn.Module:
    """Replace the in-place rewrite ``model`` computes with by ``gm`` (until it is in
    place, other threads' calls compute with the old one)."""
    old = model.__dict__.get("forward")
    names = old.names if isinstance(old, InplaceForward) else _keywords(
        type(model).forward.__get__(model))
    InplaceForward(model, names, plan).put(gm)
    return model
