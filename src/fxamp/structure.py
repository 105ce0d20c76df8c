"""What a rewritten module's graphs depend on in the model, checked at the start of every call.

The graphs read the model's own modules, Parameters and buffers (the rewrite shares them, see
:func:`share_modules`), so a replaced Parameter or buffer, ``load_state_dict(assign=True)``,
``model.to(device)`` and ``train()`` / ``eval()`` are followed without any per-call copy.
What a graph cannot follow is a change of the model's structure after the rewrite:

- a submodule replaced, added or deleted, or of another class (``register_parametrization``
  swaps the class), or with a ``forward`` patched on the instance;
- Parameters of another dtype (``model.half()``, ``.double()``, ``.to(dtype)``);
- a hook registered on a module whose ops a graph runs without calling it (it would not run).

:meth:`Structure.check` compares a key of the model (the ids of every module's children,
Parameters and buffers, their classes, training flags, patched forwards and Parameter dtypes;
built by C-level ``map`` calls, no Python call per module) with the one taken at the rewrite,
and tests the watched hook dicts with one ``any``. On a difference it names the change:
followable ones (tensors replaced, flags changed) are followed and the key taken anew; a
structural change raises :class:`StructureChanged` (an in-place rewrite re-plans on it,
``rewriter/inplace.py``; a returned module refuses, naming it).
"""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch.fx as fx
import torch.nn as nn

from .errors import UnsupportedModelError
from .ops import fetch_attr
from .program import RESULT
from .runtime import CALL_HOOKS

log = logging.getLogger(__name__)

_CHILD_DICTS = ("_modules", "_parameters", "_buffers")
_NOT_NONE = functools.partial(operator.is_not, None)
_DTYPE = operator.attrgetter("dtype")
_TRAINING = operator.attrgetter("training")
_chain = itertools.chain
_values = dict.values


class StructureChanged(UnsupportedModelError):
    """The model changed after its rewrite in a way its graphs cannot follow.

    ``replan``: an in-place rewrite can follow it by planning the model again."""

    def __init__(self, message: str, replan: bool = True) -> None:
        super().__init__(message)
        self.replan = replan


def inside(path: str, regions: Sequence[str]) -> bool:
    """Whether the module at ``path`` is inside one of ``regions`` (not one of them).

    Args:
        path: a module path in the model.
        regions: module paths.
    """
    return bool(regions) and path.startswith(tuple(f"{region}." for region in regions))


class Structure:
    """The model a rewritten module (``gm``) was made from and what its graphs read of it.

    ``inplace``: the model computes with ``gm`` (its flags are the model's); else ``gm`` is a
    module of its own that shares the model's submodules. ``hooked``: paths of the modules
    the graphs run as ops (their later hooks would not run). ``regions``: the paths of the
    modules ``gm`` calls that compute with rewrites of their own (block mode's glue calls its
    blocks so), whose insides it does not read: not watched."""

    def __init__(self, model: nn.Module, gm: nn.Module, hooked: List[str],
                 inplace: bool = False, regions: Tuple[str, ...] = ()) -> None:
        self.model = model  # (held: the key holds its modules anyway)
        self._gm = weakref.ref(gm)
        self.hooked = hooked
        self.inplace = inplace
        self.regions = regions
        self.take()

    def _named(self) -> List[Tuple[str, nn.Module]]:
        """The model's modules by path, those inside its regions left out."""
        return [(path, m) for path, m in self.model.named_modules(remove_duplicate=False)
                if not inside(path, self.regions)]

    # -- the key -------------------------------------------------------------------------
    def take(self) -> None:
        """Record the model as it is now (its key, its modules, the watched hook dicts)."""
        model = self.model
        if model is None:
            return
        named = self._named()
        self.modules = [m for _, m in named]
        self.own_dicts = [m.__dict__ for m in self.modules]
        self.child_dicts = [getattr(m, kind) for m in self.modules for kind in _CHILD_DICTS]
        self.param_dicts = [m._parameters for m in self.modules]
        self.detail = _detail(named)
        found = []
        for path in self.hooked:
            try:
                found.append((path, model.get_submodule(path)))
            except AttributeError:
                continue
        self.watched = [(p, weakref.ref(m)) for p, m in found]
        self.hook_dicts = [getattr(m, kind) for _, m in found for kind in CALL_HOOKS]
        self.no_hooks = [{} for _ in self.hook_dicts]
        self.key = self.now()

    def now(self) -> tuple:
        """The model's key now, and whether the watched hook dicts are all empty (C-level
        ``map`` / ``chain`` over the recorded dicts: no Python call per module)."""
        modules = self.modules
        return (tuple(map(id, _chain(*map(_values, self.child_dicts)))),
                tuple(map(type, modules)), tuple(map(_TRAINING, modules)),
                tuple(map(operator.contains, self.own_dicts, itertools.repeat("forward"))),
                tuple(map(_DTYPE, filter(_NOT_NONE, _chain(*map(_values, self.param_dicts))))),
                self.hook_dicts == self.no_hooks)

    def check(self) -> None:
        """The per-call check: nothing to do while the model is as recorded."""
        if self.key is None:  # (a copy or an unpickled module: recorded on first use)
            self.take()
        key = self.now()
        if key[:-1] != self.key[:-1]:
            self._changed()
        if not key[-1]:
            self._refuse_hooks()

    # -- what changed ------------------------------------------------------------------
    def _changed(self) -> None:
        model, gm = self.model, self._gm()
        if model is None or gm is None:
            return
        before = self.detail
        after = _detail(self._named())
        structural = _structural(before, after, type(model).__name__)
        if structural:
            what = "; ".join(structural)
            if self.inplace:
                raise StructureChanged(what)
            raise StructureChanged(
                f"{what}, after amp_rewrite: the returned module's graphs were planned for "
                "the model as it was and cannot follow that. what to do: rewrite the model "
                "again (fxamp.amp_rewrite), or rewrite it with inplace=True, which plans the "
                "model again when it changes", replan=False)
        resync(model, gm, self.inplace, before)
        log.debug("%s: Parameters, buffers or training flags changed after the rewrite: "
                  "followed", type(model).__name__)
        self.take()

    def _refuse_hooks(self) -> None:
        found = []
        for path, ref in self.watched:
            module = ref()
            for kind in CALL_HOOKS if module is not None else ():
                for hook in getattr(module, kind, {}).values():
                    name = getattr(hook, "__qualname__", type(hook).__qualname__)
                    found.append(f"{path or 'the model'} ({kind.strip('_')[:-1]}: {name})")
        if not found:  # (hook dicts replaced since: watch the ones the modules hold now)
            self.take()
            return
        if self.inplace:  # (planned again: a submodule with hooks stays a call)
            raise StructureChanged(f"hooks were registered on {'; '.join(found)}")
        raise UnsupportedModelError(
            "hooks were registered after amp_rewrite on submodules whose ops the rewritten "
            f"graph runs without calling them, so they would not run: {'; '.join(found)}; "
            "what to do: register them before amp_rewrite (a submodule with hooks stays a "
            "call that runs them) and rewrite again, or remove them (handle.remove())")

    def __getstate__(self) -> dict:  # (copies and pickles watch the copied model)
        return {"model": self.model, "gm": self._gm(), "hooked": self.hooked,
                "inplace": self.inplace, "regions": self.regions}

    def __setstate__(self, state: dict) -> None:
        # (the model may be half copied yet: recorded at the first check)
        self.model, self._gm = state["model"], weakref.ref(state["gm"])
        self.hooked, self.inplace, self.key = state["hooked"], state["inplace"], None
        self.regions = state.get("regions", ())


def _detail(named: List[Tuple[str, nn.Module]]) -> Dict[str, tuple]:
    """Per module path: (module id, class, forward patched, {Parameter name: (id, dtype)},
    {buffer name: (id, dtype)})."""
    out = {}
    for path, m in named:
        if path in out:
            continue
        params = {k: (id(p), p.dtype) for k, p in m._parameters.items() if p is not None}
        buffers = {k: (id(b), b.dtype) for k, b in m._buffers.items() if b is not None}
        out[path] = (id(m), type(m), "forward" in m.__dict__, params, buffers)
    return out


def _structural(before: Dict[str, tuple], after: Dict[str, tuple], root: str) -> List[str]:
    """The changes from ``before`` to ``after`` that graphs cannot follow, in words."""
    out: List[str] = []
    for path in before:
        name = path or root
        if path not in after:
            out.append(f"{name} was deleted")
            continue
        (mid, cls, patched, params, buffers), (mid2, cls2, patched2, params2, buffers2) = (
            before[path], after[path])
        if cls2 is not cls and path:  # (the root: a wrapper's class swap, fully_shard)
            out.append(f"{name} became a {cls2.__name__} (was {cls.__name__}"
                       + (": a parametrization" if cls2.__name__.startswith("Parametrized")
                          else "") + ")")
        elif mid2 != mid and path:
            out.append(f"{name} was replaced by another {cls.__name__}")
        if patched2 and not patched:
            out.append(f"{name}.forward was replaced on the instance")
        for kind, old, new in (("Parameter", params, params2), ("buffer", buffers, buffers2)):
            for key, (_, dtype) in old.items():
                if key in new and new[key][1] != dtype:
                    out.append(f"{name}.{key} became {new[key][1]} (was {dtype}; "
                               "model.half(), .double() or .to(dtype))")
            gone = sorted(set(old) - set(new))
            if gone:
                out.append(f"{name} lost its {kind}s {', '.join(gone)}")
    for path in after:
        if path not in before and not any(path.startswith(p + ".") for p in after
                                          if p not in before):
            out.append(f"{path} was added")
    return out


_PLAIN_KEYS = frozenset(nn.Module().__dict__)


def _same_tree(mine: nn.Module, theirs: Optional[nn.Module]) -> bool:
    """Whether ``mine`` (a container the rewrite made) holds nothing but what ``theirs``
    holds at the same paths: it can be replaced by ``theirs``."""
    if theirs is None or type(mine) is not nn.Module:
        return False
    for kind in ("_parameters", "_buffers"):
        their_dict = getattr(theirs, kind)
        if any(t is not their_dict.get(k) for k, t in getattr(mine, kind).items()):
            return False
    if any(k not in _PLAIN_KEYS and getattr(theirs, k, None) is not v
           for k, v in mine.__dict__.items()):
        return False
    return all(c is theirs._modules.get(k) or _same_tree(c, theirs._modules.get(k))
               for k, c in mine._modules.items())


def share_modules(gm: nn.Module, model: nn.Module) -> int:
    """Replace the containers the tracer made in ``gm`` (plain ``nn.Module`` objects that
    hold the model's own submodules and tensors) by the model's modules at the same paths,
    so the graph reads the model itself: a replaced Parameter or buffer, or a training flag
    set, reaches it with no copy. Containers that also hold the rewrite's own modules (a
    nested rewrite, a checkpoint region) stay, and are kept in step by :func:`resync`.
    Returns the containers replaced."""
    shared = 0

    def walk(mine: nn.Module, theirs: nn.Module) -> None:
        nonlocal shared
        for name, child in list(mine._modules.items()):
            other = theirs._modules.get(name)
            if other is None or child is other:
                continue
            if _same_tree(child, other):
                mine._modules[name] = other
                shared += 1
            elif type(child) is nn.Module:
                walk(child, other)

    walk(gm, model)
    return shared


def mirrors(gm: nn.Module, model: nn.Module) -> List[Tuple[str, nn.Module, nn.Module]]:
    """(path, module of ``gm``, the model's module at that path) for each module the rewrite
    made that stands for one of the model's (``gm`` itself first)."""
    originals = dict(model.named_modules())
    own = {id(m) for m in originals.values()}
    return [(path, m, originals[path]) for path, m in gm.named_modules()
            if id(m) not in own and path in originals]


def resync(model: nn.Module, gm: nn.Module, inplace: bool,
           before: Optional[Dict[str, tuple]] = None) -> None:
    """The rewrite's own containers take the Parameters and buffers the model replaced at
    the same paths since ``before`` (its recorded detail; all of them when None) and, in
    place, the model's training flags: run when the structure key changed. A tensor swapped
    on ``gm``'s own container (``torch.func.functional_call(gm, ...)``) is left alone."""
    for path, mine, theirs in mirrors(gm, model):
        if inplace:
            mine.training = theirs.training
        old = before.get(path) if before is not None else None
        for index, kind in ((3, "_parameters"), (4, "_buffers")):
            my_dict, their_dict = getattr(mine, kind), getattr(theirs, kind)
            recorded = old[index] if old is not None else {}
            for name in list(my_dict):
                value = their_dict.get(name)
                if value is None or my_dict[name] is value:
                    continue
                if old is None or recorded.get(name, (None,))[0] != id(value):
                    my_dict[name] = value


def hooked_paths(gm: fx.GraphModule) -> List[str]:
    """Paths of the modules ``gm``'s graphs (its own and those of the graph modules inside
    it that are parts of it, such as checkpoint regions' bodies) run as ops, not as calls:
    a hook registered on one later would not run."""
    parts = [m for m in gm.modules() if isinstance(m, fx.GraphModule)
             and (m is gm or RESULT not in m.__dict__)]
    called = set()
    for part in parts:
        for n in part.graph.nodes:
            if n.op == "call_module" or (n.op == "get_attr" and isinstance(
                    fetch_attr(part, str(n.target)), nn.Module)):
                called.add(str(n.target))
    paths = set()
    for part in parts:
        for node in part.graph.nodes:
            for value in (node.meta.get("nn_module_stack") or {}).values():
                path = value[0] if isinstance(value, tuple) else None
                if isinstance(path, str) and path and path not in called:
                    paths.add(path)
    return sorted(p for p in paths if not any(p.startswith(c + ".") for c in called))
