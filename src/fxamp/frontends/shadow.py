"""The shadow tree: what a rewrite traces instead of the user's modules.

A rewrite runs the model's code many times (fx's symbolic trace, torch.export's fake-tensor
run, the fake-tensor propagation that plans each node, the ``observe`` runs under autocast,
the FP32 run that checks a failed rewrite). Those runs swap the modules' Parameters and
buffers for fake tensors or copies (``functional_call``, ``_reparametrize_module``), set
training flags, take hooks off and write caches, and put everything back after. Done on the
user's own module objects, another thread training or calling them at that moment would see
it: fake tensors as outputs, gradients lost, a BatchNorm count lost.

So a rewrite works on a *shadow* of the model (:class:`Shadow`): new module objects, one per
module of the model, of the same classes, each a shallow copy with its own ``__dict__``, its
own ``_parameters`` / ``_buffers`` / ``_modules`` / hook dicts and its own copies of the
other dicts, lists and sets it holds, whose entries are the model's own tensors (shared, not
copied) and the shadows of its modules. Whatever a trace swaps or sets, it swaps and sets on
the shadows; the user's modules are only read. When the rewrite is done,
:meth:`Shadow.to_real` makes the rewritten module hold the user's modules where it holds
shadows (so it shares the model's Parameters, buffers and flags, as before), and its
structure check watch the user's model. :func:`real_of` gives the user's module a shadow
stands for (the eager front end reads and shares the real child's attributes and hooks).

Buffer *values* are shared: the runs that could update them (BatchNorm in train mode) use
copies of the buffers, as before (``frontends/state.py``, ``buffer_writes.py``).
"""
from __future__ import annotations

import collections
import functools
import types
import weakref
from typing import Any, Dict, Optional, Tuple

import torch.nn as nn

from ..result import RESULT, Rewritten, set_result
from ..structure import Structure
from .hooks import CALL_HOOK_DICTS

#: each shadow module -> the :class:`Shadow` it belongs to
_TREE: "weakref.WeakKeyDictionary[nn.Module, Shadow]" = weakref.WeakKeyDictionary()

_COPIED = (dict, collections.OrderedDict, list, set)


def real_of(module: nn.Module) -> nn.Module:
    """The user's module that ``module`` is the shadow of.

    Args:
        module: a module, a shadow or not.

    Returns:
        the user's module (``module`` itself when it is no shadow).
    """
    tree = _TREE.get(module)
    return module if tree is None else tree.real[id(module)]


class Shadow:
    """A shadow of ``model``'s module tree (see the module docstring).

    Args:
        model: the user's model (or a shadow: the new one stands for the same modules).
        on_call: ``model`` is an in-place model planned on one of its calls: the shadow's
            root has none of its call hooks (they run around the new graph) and not the
            forward set on it while it is planned (``rewriter/inplace.py``): the class's
            forward is what is traced.
    """

    def __init__(self, model: nn.Module, on_call: bool = False) -> None:
        self.of: Dict[int, nn.Module] = {}  # id(the model's module) -> its shadow
        self.real: Dict[int, nn.Module] = {}  # id(a shadow) -> the user's module
        self.copies: Dict[int, Tuple[Any, Any]] = {}  # id(a copied container) -> (it, the
        # user's)
        modules = list(model.modules())
        for module in modules:
            shadow = object.__new__(type(module))
            self.of[id(module)] = shadow
            self.real[id(shadow)] = real_of(module)
        memo: Dict[int, Any] = {}
        for module in modules:
            shadow = self.of[id(module)]
            outer = _TREE.get(module)  # (a shadow's shadow: its copies stand for the user's)
            shadow.__dict__.update({name: self._copy(value, memo, outer)
                                    for name, value in module.__dict__.items()})
            _TREE[shadow] = self
        self.root = self.of[id(model)]
        if on_call:
            self.bare("")

    def bare(self, path: str) -> None:
        """The shadow of the module at ``path`` without the ``forward`` set on the instance
        (an in-place rewrite's) and without call hooks: a trace keeping it as a call runs
        its class's code (block mode's glue runs its blocks so while it is planned, as
        ``torch.autocast`` would run them), never the user's module's own rewrite.

        Args:
            path: the module's path in the model.
        """
        module = self.root.get_submodule(path)
        module.__dict__.pop("forward", None)
        for kind in CALL_HOOK_DICTS:
            if getattr(module, kind, None):
                module.__dict__[kind] = collections.OrderedDict()

    def release(self) -> None:
        """Forget this tree's shadows once the rewrite that needed them is done (the map
        from each shadow to its tree holds the tree, and the tree its shadows: without this
        the user's modules, which the tree names, would stay alive for good)."""
        for shadow in self.of.values():
            _TREE.pop(shadow, None)

    def _item(self, value: Any) -> Any:
        """A value held by a module of the model, as its shadow holds it: a module of the
        model is its shadow, a method bound to one is bound to the shadow, and so is a
        ``functools.partial`` of one (accelerate's hooked ``forward``)."""
        if isinstance(value, nn.Module):
            return self.of.get(id(value), value)
        if isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module) \
                and id(value.__self__) in self.of:
            return types.MethodType(value.__func__, self.of[id(value.__self__)])
        if type(value) is functools.partial and any(
                isinstance(a, nn.Module) and id(a) in self.of for a in value.args):
            bound = functools.partial(value.func, *map(self._item, value.args),
                                      **value.keywords)
            bound.__dict__.update({k: self._item(v) for k, v in vars(value).items()})
            return bound
        return value

    def _copy(self, value: Any, memo: Dict[int, Any], outer: Optional["Shadow"]) -> Any:
        """``value`` (an attribute of a module of the model) for its shadow: a dict, list or
        set of its own (one copy per object: one held twice stays one), its items as
        :meth:`_item`. ``outer``: the tree the module is a shadow of, if it is one."""
        if type(value) not in _COPIED:
            return self._item(value)
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, dict):
            copied: Any = type(value)((k, self._item(v)) for k, v in value.items())
        else:
            copied = type(value)(self._item(v) for v in value)
        memo[id(value)] = copied
        entry = outer.copies.get(id(value)) if outer else None
        user = entry[1] if entry is not None and entry[0] is value else value
        self.copies[id(copied)] = (copied, user)  # (a shadow's copy stands for the user's)
        return copied

    def to_real(self, result: nn.Module) -> nn.Module:
        """Make ``result`` (the rewritten module) and the modules it holds hold the user's
        modules where they hold shadows (and the user's dicts, lists and sets where they
        hold a shadow's copies: an eager root is a copy of the shadow root), and the
        structure checks of the results in it watch the user's modules.

        Args:
            result: the rewritten module.

        Returns:
            ``result`` (the user's model when it is the shadow's root).
        """
        shadows = self.real  # (id of each shadow -> the user's module)
        if id(result) in shadows:
            return shadows[id(result)]
        seen: set = set()
        todo = [result]
        while todo:
            module = todo.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, child in list(module._modules.items()):
                if child is not None and id(child) in shadows:
                    module._modules[name] = self.real[id(child)]
                elif child is not None:
                    todo.append(child)
            for name, value in list(module.__dict__.items()):  # (an eager root's, a copy of
                if isinstance(value, nn.Module) and id(value) in shadows:  # the shadow root)
                    module.__dict__[name] = self.real[id(value)]
                elif id(value) in self.copies and self.copies[id(value)][0] is value:
                    module.__dict__[name] = self.copies[id(value)][1]
            done = module.__dict__.get(RESULT)
            if isinstance(done, Rewritten) and done.structure is not None:
                self._watch_real(module, done)
        return result

    def _watch_real(self, module: nn.Module, done: Rewritten) -> None:
        structure = done.structure
        watched = structure.model
        if watched is None or id(watched) not in self.real:
            return
        set_result(module, done.replace(structure=Structure(
            self.real[id(watched)], module, structure.hooked, structure.inplace,
            structure.regions)))


def twin(model: nn.Module) -> nn.Module:
    """A module tree beside ``model``: one new module per module of it, of the same class,
    as a shadow is (its own dicts and flags; the model's Parameters and buffers, shared),
    forgotten as a shadow, so it stands for nothing but itself. A returned rewrite that
    keeps the module tree (``partition="blocks"``) is a twin rewritten in place: the
    model keeps its own forward and trains the same Parameters.

    Args:
        model: the user's model.
    """
    tree = Shadow(model)
    tree.release()
    return tree.root
