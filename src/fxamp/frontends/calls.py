"""The call structure a rewritten graph was traced for, checked on each call.

A graph is traced for one structure of the forward's arguments: which are tensors, which
are None and which are left out (a ``mask is not None`` branch is taken or not, a
placeholder exists or not), and what a list or tuple of tensors holds (each item is an input
of its own). :class:`CallStructure` keeps the example's, by the model's own parameter names.
The Program's entry (``fxamp/program.py``) compares a key of each call (the arguments' types
and keyword names: C-level, no Python call) with the keys already seen to fit; where the
example has Python values the graph fixed or lists of tensors, a key alone does not decide,
so the entry also compares what the key leaves out (those values, and the item types of each
list: :func:`fxamp.program.call_values`) with the readings seen to fit for that key. Only a
new key or reading reaches :meth:`CallStructure.admit`, which binds the call to the model's
forward and

- refuses another structure with :class:`~fxamp.errors.CallStructureError`, naming the
  argument, what the example had and the example to rewrite with;
- passes a call of the example's form on (its key, with its values where they count, is
  remembered: the next such call costs the key and that reading alone);
- gives the graph a call of the same structure in another form (a keyword given
  positionally, a None default given or left out) as the graph's positional inputs (bound
  on each such call).
"""
from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, Dict, FrozenSet, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..errors import CallStructureError
from ..program import call_key, call_values

log = logging.getLogger(__name__)

#: the kinds of an argument that change what a graph traces
TENSOR, NONE, VALUE = "tensor", "none", "value"
_MISSING = object()
#: Python values torch.export specialises a graph on
_SCALARS = (bool, int, float, str)
_NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
          inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def kind(value: Any) -> Any:
    """What a graph sees of an argument: a tensor, None or another value; for a list or
    tuple holding tensors (traced element by element) its type and each item's kind."""
    if isinstance(value, torch.Tensor):
        return TENSOR
    if holds_tensors(value):
        return (type(value).__name__, tuple(map(kind, value)))
    return NONE if value is None else VALUE


def holds_tensors(value: Any) -> bool:
    """A plain list or tuple with a tensor in it (at any depth): the fx front end traces
    each of its items as an input of its own."""
    return type(value) in (list, tuple) and any(
        isinstance(v, torch.Tensor) or holds_tensors(v) for v in value)


def _described_only(value: Any) -> Any:
    """What the check keeps of an example value: a tensor as an empty ``meta`` tensor of its
    dtype and shape (its kind and description, no memory: an activation a block was first
    called with would keep its whole autograd graph alive), anything else as it is."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if holds_tensors(value):
        return type(value)(map(_described_only, value))
    return value


def _described(value: Any, given: bool) -> str:
    """An argument as a message names it."""
    if not given:
        return "left out" + (" (None by default)" if value is None else "")
    if isinstance(value, torch.Tensor):
        return f"a tensor ({str(value.dtype).replace('torch.', '')}, {tuple(value.shape)})"
    if holds_tensors(value):
        return f"a {type(value).__name__} of {len(value)} ({_items(kind(value))})"
    return "None" if value is None else f"a {type(value).__name__}"


def _items(described: Any) -> str:
    """A list's kinds as a message names them: ``tensor, none, list of 2 (tensor, ...)``."""
    return ", ".join(k if isinstance(k, str) else f"{k[0]} of {len(k[1])} ({_items(k)})"
                     for k in described[1])


class CallStructure:
    """The example's structure by the model's forward parameters, and the call keys seen to
    have it (see the module docstring)."""

    #: (an instance's own once it remembers a call; a structure pickled before it had one
    #: reads this empty one)
    valued: Dict[Tuple[Any, ...], Tuple[Tuple[tuple, tuple], FrozenSet[tuple]]] = {}

    def __init__(self, signature: inspect.Signature, model_name: str, args: tuple,
                 kwargs: Dict[str, Any], graph: inspect.Signature,
                 values: bool = False, symbolic: frozenset = frozenset()) -> None:
        self.signature = signature
        self.graph = graph  # the graph's forward
        self.model_name = model_name
        bound = signature.bind(*args, **kwargs)
        self.example = {name: (_described_only(self._value(bound, name)),
                               name in bound.arguments)
                        for name, p in signature.parameters.items() if p.kind in _NAMED}
        # the keywords a ``**kwargs`` parameter took (num_items_in_batch, say): each is part
        # of the structure like a named argument
        self.var_keyword = next((name for name, p in signature.parameters.items()
                                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        self.extra = {k: _described_only(v) for k, v in
                      bound.arguments.get(self.var_keyword, {}).items()} \
            if self.var_keyword else {}
        # ``values``: the graph holds the example's Python scalars as constants (torch.export
        # specialises them): a call with another value is another structure
        # (but those it takes as symbols: ``symbolic``)
        self.scalars = {name: value for name, value in self._named(bound).items()
                        if type(value) in _SCALARS and name not in symbolic} if values else {}
        self.form = (len(args), frozenset(kwargs))
        # the graph's forward parameters, when each is one of the model's (else calls in
        # another form than the example's go to the graph as they are)
        targets = list(graph.parameters)
        self.targets = targets if targets and set(targets) <= set(self.example) else None
        # lists holding tensors: their items are the graph's inputs, so a list of another
        # length or kinds is another structure
        self.lists = any(holds_tensors(value) for value, _ in self.example.values())
        # (a call's key holds types alone: with scalars or lists to compare, every call is
        # admitted)
        self.direct: Set[Tuple[Any, ...]] = set() if self.scalars or self.lists \
            else {call_key(args, kwargs)}
        # the other keys admitted as they are: what admission read beyond the key (the
        # scalars' values, the lists' item types) and the readings seen to pass; replaced,
        # never changed in place (a copy shares it; a thread reads a whole entry)
        self.valued: Dict[Tuple[Any, ...], Tuple[Tuple[tuple, tuple], FrozenSet[tuple]]] = {}

    def __deepcopy__(self, memo: dict) -> "CallStructure":
        """A copy sharing the example's values (only their kinds and descriptions are read;
        an activation a block was first called with is no graph leaf to copy)."""
        new = copy.copy(self)
        new.direct = set(self.direct)
        new.valued = dict(self.valued)
        memo[id(self)] = new
        return new

    def _named(self, bound: inspect.BoundArguments) -> Dict[str, Any]:
        """The call's values by name: the named parameters and the ``**kwargs`` keywords."""
        values = {name: self._value(bound, name) for name in self.example}
        if self.var_keyword:
            values.update(bound.arguments.get(self.var_keyword, {}))
        return values

    def _value(self, bound: inspect.BoundArguments, name: str) -> Any:
        if name in bound.arguments:
            return bound.arguments[name]
        default = self.signature.parameters[name].default
        return None if default is inspect.Parameter.empty else default

    def admit(self, args: tuple, kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
        """The call as the graph takes it; raises CallStructureError for another structure
        (a call the forward cannot bind goes on as it is: the graph raises Python's
        TypeError)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return args, kwargs
        for name, (example, given) in self.example.items():
            value = self._value(bound, name)
            if kind(value) != kind(example):
                self._refuse(name, example, given, value, name in bound.arguments)
        if self.var_keyword:
            extra = bound.arguments.get(self.var_keyword, {})
            for name in sorted(set(extra) | set(self.extra)):
                value, example = extra.get(name), self.extra.get(name)
                if name not in extra or name not in self.extra \
                        or kind(value) != kind(example):
                    self._refuse(name, example, name in self.extra, value, name in extra)
        if self.scalars:
            named = self._named(bound)
            for name, example in self.scalars.items():
                value = named.get(name, _MISSING)
                if type(value) is not type(example) or value != example:
                    self._refuse_value(name, example, value)
        if self.targets is None:
            if (len(args), frozenset(kwargs)) == self.form:
                self._remember(args, kwargs)
            return args, kwargs
        values = tuple(self._value(bound, name) for name in self.targets)
        if self._binds_alike(args, kwargs, values):  # (as the graph's forward takes it)
            self._remember(args, kwargs)
            return args, kwargs
        return values, {}

    def _remember(self, args: tuple, kwargs: Dict[str, Any]) -> None:
        """Remember a call admitted as it is, for the entry to pass the next alike call
        without :meth:`admit`: by its key alone where nothing else counts (no scalar the
        graph fixed is given, no list is passed), else with what it read of the call's
        values (:func:`~fxamp.program.call_values`): the scalars' values, the lists' item
        types. A call whose lists hold containers (kinds a level deeper) is not remembered.

        Args:
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
        """
        key = call_key(args, kwargs)
        flat = (*args, *kwargs.values())
        lists = tuple(i for i, value in enumerate(flat) if type(value) in (list, tuple))
        scalars: tuple = ()
        if self.scalars:
            where = self._positions(args, kwargs)
            scalars = tuple(where[name] for name in self.scalars if name in where)
        if not scalars and not lists:  # (the key decides)
            self.direct.add(key)
            return
        reading = call_values(args, kwargs, (scalars, lists))
        if any(t in (list, tuple) for items in reading[len(scalars):] for t in items):
            return
        seen = self.valued.get(key)
        known = seen[1] if seen is not None else frozenset()
        self.valued = {**self.valued, key: ((scalars, lists), known | {reading})}

    def _positions(self, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, int]:
        """Where each argument the call gives is in ``(*args, *kwargs.values())``, by the
        forward's parameter name (a ``**kwargs`` keyword by its own)."""
        where = {}
        params = iter(self.signature.parameters.values())
        for index in range(len(args)):
            param = next(params, None)
            if param is None or param.kind not in _POSITIONAL:
                break  # (the rest go to ``*args``)
            where[param.name] = index
        where.update((name, len(args) + i) for i, name in enumerate(kwargs))
        return where

    def _binds_alike(self, args: tuple, kwargs: Dict[str, Any], values: tuple) -> bool:
        """Whether the graph's forward binds the call to ``values`` itself (the binding
        depends on the call's key alone: the key can skip this check from now on)."""
        try:
            bound = self.graph.bind(*args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        return all(bound.arguments.get(name, _MISSING) is value
                   for name, value in zip(self.targets or (), values))

    def _refuse_value(self, name: str, example: Any, value: Any) -> None:
        err = CallStructureError(
            f"{self.model_name} was called with {name!r} = {_shown(value)}; its rewrite's "
            f"example had {name!r} = {example!r}. Its graph holds the example's Python values "
            f"as constants (as torch.export takes them), so it runs that value alone\n  "
            f"what to do: rewrite with inplace=True (each value is planned on its first "
            f"call), or with an example that has {name!r} = {_shown(value)} for those calls")
        err.scalar = name  # type: ignore[attr-defined]  # (a value the graph fixed)
        raise err

    def _refuse(self, name: str, example: Any, given: bool, value: Any,
                passed: bool) -> None:
        if isinstance(value, torch.Tensor):
            shown = (f"example_kwargs={{{name!r}: <a {str(value.dtype).replace('torch.', '')}"
                     f" tensor shaped like the calls' {tuple(value.shape)}>}}")
        elif holds_tensors(value):
            shown = (f"example_kwargs={{{name!r}: <a {type(value).__name__} of "
                     f"{len(value)} like the calls'>}}")
        else:
            shown = (f"example_kwargs={{{name!r}: None}}, or leave {name!r} out of the "
                     "example")
        raise CallStructureError(
            f"{self.model_name} was called with {name!r} {_described(value, passed)}; its "
            f"rewrite's example had {name!r} {_described(example, given)}. The rewritten "
            f"graph is traced for the example's structure (which arguments are tensors, None "
            f"or left out, and the items of a list of tensors) and runs that one alone\n  "
            f"what to do: rewrite with an example of the structure you call with: "
            f"amp_rewrite(model, example_inputs, {shown}); for calls of both structures, "
            "rewrite a copy of the model for each")


def _shown(value: Any) -> str:
    return "left out" if value is _MISSING else repr(value)


def call_structure(gm: nn.Module, model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                   values: bool = False, symbolic: frozenset = frozenset()
                   ) -> Optional["CallStructure"]:
    """The example's :class:`CallStructure`, which the rewritten module ``gm`` (a Program)
    checks on entry (``Rewritten.calls``); None when the model's forward cannot be read.

    Args:
        gm: the rewritten module.
        model: the model it was made from (its forward's parameters name the arguments).
        args: the example's positional arguments.
        kwargs: the example's keyword arguments.
        values: the graph holds the example's Python scalars (bool, int, float, str) as
            constants (torch.export specialises them): a call with another value is refused.
        symbolic: the names of those the graph takes as inputs (symbols): not compared.

    Returns:
        The call structure, or None.
    """
    try:
        signature = inspect.signature(model.forward)
        structure = CallStructure(signature, type(model).__name__, tuple(args),
                                  dict(kwargs), inspect.signature(gm.forward), values,
                                  symbolic)
    except (TypeError, ValueError) as err:
        log.debug("%s: call structure not checked: %s", type(model).__name__, err)
        return None
    return structure
