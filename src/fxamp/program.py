"""The module type every rewritten graph is: :class:`Program`, the one owner of what runs on
each call.

A call of a Program runs, in this order and on every exit path:

1. the structure check (:class:`fxamp.structure.Structure`, kept in the result): the model's
   modules, Parameters, buffers, training flags and dtypes against what the graphs were built
   on, and the hooks registered since on modules the graphs run as ops (every graph part:
   checkpoint regions included). While nothing changed this is a few C-level comparisons;
2. the mode check: a graph traced for one training mode only (its model traces differently
   in train and eval mode) hands a call in the other to that mode's graph, planned on its
   first call (``Rewritten.other_mode``, a top-level returned module's), or refuses it with
   ``ModeError`` where nothing plans it;
3. the call structure check (:mod:`fxamp.frontends.calls`, kept in the result): the
   arguments' types and keyword names against the call forms seen to have the example's
   structure (tensor, None or left out per argument). While they match this is one C-level
   tuple and set lookup; where the graph also fixed Python scalars or takes lists of tensors,
   the form's key with those scalars' values and the lists' item types
   (:func:`call_values`: one Python call). Another structure or value is refused naming the
   argument;
4. on the Program's first call only (one ``__dict__`` lookup on the later ones), the device
   check: a plan for one of "cpu" / "cuda" run on the other logs one warning naming both
   (their autocast lists differ, so its numbers are not that device's autocast's);
5. every ``torch.autocast`` around the call turned off (the plan says each node's dtype, the
   casts are explicit), and turned back on in a ``finally``, also when the graph raises;
6. the graph (the generated ``forward``); an exported graph's failing input guard (a bare
   ``AssertionError: Guard failed: ...``) is raised as ``InputShapeError`` naming the
   condition and the inputs it reads (:func:`guard_error`).

The Program adds nothing else per call: no per-call copy of flags or tensors, no weight cache
(each weight is cast in the graph, as autocast casts it), no process-wide state. Two things
run around it where a rewrite asks for them: the export front end's forward pre-hooks
(``frontends/aten.py``: the input shape check, ``ShapeCheck``, and ``plain_inputs_hook``),
which ``nn.Module.__call__`` runs before the Program's forward; and, for an in-place rewrite,
the model's own ``forward`` replaced by :class:`fxamp.rewriter.inplace.InplaceForward`, which
picks (or plans) the graph for the call and calls it.
"""
from __future__ import annotations

import copy
import functools
import logging
import re
import weakref
from itertools import repeat
from typing import Any, Callable, Dict, FrozenSet, Optional, Protocol, Set, Tuple

import torch
import torch.fx as fx

from .errors import InputShapeError, ModeError
from .runtime import (CALL_HOOK_DICTS, OWN, fan_out, first_device, own_autocast_depth,
                      shared_cast)

log = logging.getLogger(__name__)

#: the device types autocast knows on this torch (checked once)
DEVICES: Tuple[str, ...] = tuple(d for d in ("cpu", "cuda", "xpu", "mps")
                                 if torch.amp.is_autocast_available(d))
_ENABLED = torch.is_autocast_enabled
_SET = torch.set_autocast_enabled
_COMPILING = torch.compiler.is_compiling
_WARNED: list = []
#: the key a Program's ``__dict__`` holds once its first call's device was checked against
#: its plan's target (:func:`_check_device`)
DEVICE_CHECKED = "fxamp_device_checked"
#: the plans whose device was checked, by id (held weakly: a plan is no key of its own)
_PLANS_CHECKED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
#: set on a Program while it is pickled: its code is generated from the graph itself
_PICKLING = "fxamp_pickling"
#: the attribute the rewrite's result is kept under (the one definition; ``fxamp.result.RESULT``
#: and ``fxamp.structure`` read it from here)
RESULT = "fxamp_result"


class EntryCheck(Protocol):
    """What a Program checks each call's arguments against (``Rewritten.calls``; the one
    kind is ``fxamp.frontends.calls.CallStructure``): the call keys (:func:`call_key`) it
    takes as they are, and ``admit`` for any other call."""

    direct: Set[Tuple[Any, ...]]
    #: call keys whose admission depends on values the key does not hold (Python scalars
    #: the graph fixed, the items of lists of tensors): per key, what to read of the call
    #: (:func:`call_values`) and the readings seen to be admitted as they are
    valued: Dict[Tuple[Any, ...], Tuple[Tuple[tuple, tuple], FrozenSet[tuple]]]

    def admit(self, args: tuple, kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
        """The call's arguments as the graph takes them, or a ``CallStructureError``."""
        ...


def call_key(args: tuple, kwargs: dict) -> tuple:
    """A call's key for the call structure check: its arguments' types and keyword names
    (the expression :func:`_owned` computes inline)."""
    return (*map(type, args), *kwargs, *map(type, kwargs.values()))


def call_values(args: tuple, kwargs: dict, picks: Tuple[tuple, tuple]) -> tuple:
    """What a call's key does not hold but its admission reads (the expression
    :func:`_owned` runs on a key in ``EntryCheck.valued``): the values at positions
    ``picks[0]`` of ``(*args, *kwargs.values())`` (Python scalars), then the item types of
    those at ``picks[1]`` (lists and tuples). C-level: no Python call but this one.

    Args:
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
        picks: (scalar positions, list positions) in the call's arguments.

    Returns:
        The values, then a tuple of item types per list.
    """
    get = (*args, *kwargs.values()).__getitem__
    return (*map(get, picks[0]), *map(tuple, map(map, repeat(type), map(get, picks[1]))))


def _note_outer_autocast(was: Tuple[str, ...]) -> None:
    """Log once per process that a rewritten model ran under the user's autocast."""
    if not _WARNED and not own_autocast_depth() and not _COMPILING():
        _WARNED.append(True)
        log.warning("a rewritten model was called under torch.autocast(%s): autocast is "
                    "turned off inside it, so every node computes in the dtype its plan "
                    "says (the casts are explicit); the model does not need it, and what "
                    "you compute with its outputs inside it (a loss) runs under it as usual",
                    ", ".join(was))


def _refuse_mode(program: Any, result: Any) -> None:
    """A call in the mode ``program``'s graph was not traced for (``result.mode`` is the
    one it was), where nothing plans the other: refused, naming the model."""
    have, other = ("train", "eval") if result.mode else ("eval", "train")
    model = (result.source or type(program).__name__).rsplit(".", 1)[-1]
    raise ModeError(
        f"{model} was called in {other} mode, but its model traces "
        f"differently in train and eval mode and its rewritten graph is for {have} mode only "
        f"(it never runs a graph traced for another mode). what to do: rewrite with "
        f"inplace=True, which plans each mode on its first call in it; or rewrite a copy in "
        f"{other} mode for those calls: amp_rewrite(copy.deepcopy(model)."
        f"{'train' if other == 'train' else 'eval'}(), ...)")


def _check_device(program: Any, result: Any, args: tuple, kwargs: dict) -> None:
    """On a Program's first call: one warning when it runs on a CPU or CUDA device whose
    autocast lists are not the ones its plan mirrors (a plan for "cuda" run on the CPU, or
    the reverse); once per plan object, so the blocks that share one do not each warn.
    The device is that of the first floating Parameter or buffer the Program reads, else
    of the first tensor argument; a deployment plan, or a call on another device
    (``meta``), is not checked.

    Args:
        program: the Program being called (marked checked in its ``__dict__``).
        result: its rewrite's result (``result.policy.target``, ``result.source``).
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
    """
    program.__dict__[DEVICE_CHECKED] = True
    target = result.policy.target
    plan = result.plan  # (identical blocks share one plan: it warns once)
    if target not in ("cpu", "cuda") or _PLANS_CHECKED.get(id(plan)) is plan:
        return
    _PLANS_CHECKED[id(plan)] = plan
    device = first_device(program, (args, kwargs))
    if device not in ("cpu", "cuda") or device == target:
        return
    model = (result.source or type(program).__name__).rsplit(".", 1)[-1]
    log.warning("%s was planned for target=%s (the dtypes torch.autocast(%r) gives each op) "
                "but runs on %s, whose autocast lists differ: its numbers are not those of "
                "torch.autocast(%r) on this device. what to do: rewrite it with "
                "target=%r (or without target=: the plan then follows the device the model "
                "is on when it is planned; move the model there before amp_rewrite)",
                model, target, target, device, device, device)


#: how torch.export's input guard (an exported graph's ``_guards_fn``) words a failure
GUARD_FAILED = "Guard failed: "
_NAMED = re.compile(r"\b([A-Za-z_]\w*)(?=\.size\(\)|\[)")
#: a guard on one fixed size or Python value of an input (``x.size()[1] == 12``, a float
#: in a list ``extra[1] == 1.0``): a graph planned on a call that breaks it takes that call
_FIXED = re.compile(r"^[\w.\[\]'\"]+(\.size\(\)\[\d+\])? == [\w.+\-'\"]+$")


def guard_error(program: Any, err: AssertionError) -> Optional[InputShapeError]:
    """torch.export's bare ``AssertionError: Guard failed: <condition>`` (a call the
    exported graph was not traced for) as an InputShapeError naming the condition, the
    inputs it reads and what to do; None for any other assertion. (The shape check before
    the graph names fixed sizes and bounds itself; this covers the other guards, such as
    a size the model's code needs even.)"""
    text = str(err)
    if not text.startswith(GUARD_FAILED):
        return None
    condition = text[len(GUARD_FAILED):].strip()
    names = list(dict.fromkeys(_NAMED.findall(condition)))
    result = program.__dict__.get(RESULT)
    model = (getattr(result, "source", "") or type(program).__name__).rsplit(".", 1)[-1]
    reads = (f" (it reads input{'s' if len(names) > 1 else ''} "
             f"{', '.join(repr(n) for n in names)})" if names else "")
    error = InputShapeError(
        f"the rewritten {model} was exported for calls where `{condition}` holds{reads}: "
        f"torch.export recorded it from what {model}'s code did with the example inputs, "
        "and this call breaks it, so the graph was not traced for it\n  what to do: call "
        "it with inputs for which it holds (the FP32 model often fails on such a call too: "
        "check with the model itself); or, if the model takes such inputs, rewrite it with "
        "example inputs like this call's")
    error.__cause__ = err
    if _FIXED.match(condition):  # (a size the export fixed: a miss of this graph, which a
        error.program = program  # type: ignore[attr-defined]  # graph planned on it takes)
    return error


def _owned(graph_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``graph_forward`` (the generated code) behind the structure check and the autocast
    switch, restored in ``finally``."""

    @functools.wraps(graph_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        own = self.__dict__
        result = own[RESULT] if RESULT in own else None
        if result is not None and not _COMPILING():
            guard, calls = result.structure, result.calls
            if guard is not None and (guard.key is None or guard.key != guard.now()):
                guard.check()  # (something changed: followed, re-planned or refused)
            if result.mode is not None and self.training is not result.mode:
                if result.other_mode is None:
                    _refuse_mode(self, result)
                return result.other_mode(self, args, kwargs)  # (that mode's own graph)
            if calls is not None:
                key = (*map(type, args), *kwargs, *map(type, kwargs.values()))
                if key not in calls.direct and (
                        (seen := calls.valued.get(key)) is None
                        or call_values(args, kwargs, seen[0]) not in seen[1]):
                    try:
                        args, kwargs = calls.admit(args, kwargs)  # (refused, or the graph's)
                    except Exception as err:  # (CallStructureError: a miss of this graph)
                        err.program = self
                        raise
            if DEVICE_CHECKED not in own:  # (once per module: its first call's device)
                _check_device(self, result, args, kwargs)
        was = tuple(filter(_ENABLED, DEVICES))
        if not was:
            try:
                return graph_forward(self, *args, **kwargs)
            except AssertionError as err:
                raise guard_error(self, err) or err
        if not _WARNED and not OWN.depth:  # (inline: fxamp's own regions are common)
            _note_outer_autocast(was)
        for device in was:
            _SET(device, False)
        try:
            return graph_forward(self, *args, **kwargs)
        except AssertionError as err:
            raise guard_error(self, err) or err
        finally:
            for device in was:
                _SET(device, True)

    return forward


class Program(fx.GraphModule):
    """A rewritten graph: an ``fx.GraphModule`` whose ``forward`` is the generated graph code
    run behind the structure check and with any outer autocast off (see the module
    docstring). ``program.code`` is the graph's code."""

    def recompile(self) -> Any:
        """Generate the graph's code (``GraphModule.recompile``, from :func:`code_graph`'s
        form of the graph) and put it behind the run-time contract."""
        graph = self.__dict__.get("_graph")
        shown = code_graph(graph) if graph is not None and _PICKLING not in self.__dict__ \
            else None
        if shown is None:
            code = super().recompile()
        else:
            self.__dict__["_graph"] = shown
            try:
                code = super().recompile()
            finally:
                self.__dict__["_graph"] = graph
        cls = type(self)
        cls.forward = _owned(cls.forward)  # type: ignore[method-assign]
        return code

    def __deepcopy__(self, memo: dict) -> Any:
        """``GraphModule``'s copy (which keeps only the attributes the graph reads), with
        the rewrite's result (its plan, its structure and call checks, for the copy) and
        its call hooks, as ``nn.Module``'s copy keeps them (``GraphModule``'s drops them:
        the export front end's input checks, :data:`CALL_HOOK_DICTS`)."""
        res = super().__deepcopy__(memo)
        if RESULT in self.__dict__:
            res.__dict__[RESULT] = copy.deepcopy(self.__dict__[RESULT], memo)
        for name in CALL_HOOK_DICTS:
            hooks = self.__dict__.get(name)
            if hooks:
                res.__dict__[name] = copy.deepcopy(hooks, memo)
        return res

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled like a GraphModule (its code, re-traced on load), loaded as a Program:
        the code of the graph itself (not :func:`code_graph`'s form, so the graph loaded
        is the graph pickled), re-traced with fxamp's run-time calls kept
        (``_torch.RuntimeTracer``)."""
        from ._torch import RuntimeTracer

        own = self.__dict__
        own[_PICKLING] = True
        if not issubclass(own.get("_tracer_cls") or object, RuntimeTracer):
            own["_tracer_cls"] = RuntimeTracer  # (SpellingTracer is one already)
        try:
            self.recompile()  # (GraphModule's reduce pickles the code of the last one)
            fn, (body, imports) = super().__reduce__()
        finally:
            own.pop(_PICKLING, None)
            self.recompile()
        body.pop(_PICKLING, None)
        return (_load, (fn, (body, imports)))


def _fanned_out(node: fx.Node) -> bool:
    """Whether ``node`` is a cast ``x.to(dtype)`` that only ``fan_out`` nodes use, as
    their shared cast."""
    return (node.op == "call_method" and node.target == "to" and len(node.args) == 2
            and not node.kwargs and bool(node.users)
            and all(u.op == "call_function" and u.target is fan_out and len(u.args) >= 3
                    and u.args[2] is node and node not in (*u.args[:2], *u.args[3:])
                    for u in node.users))


def code_graph(graph: fx.Graph) -> Any:
    """The graph to generate code from, where it differs from ``graph`` (None where not):

    - each nested attribute read (``get_attr`` of ``blocks.0.attn.qkv.weight``) is made
      from reads of its module's path, each path read once, just before its first use: the
      code reads ``self.blocks`` once, then ``blocks[0]``, then ``.attn``..., so a read
      costs O(1) attribute lookups instead of a chain from ``self`` (quadratic in a
      model's depth);
    - each common aten op of an exported graph is called through its Python binding
      (:func:`fxamp._torch.fast_call`: ``torch.mul`` for ``aten.mul.Tensor``), the same
      op at about half the cost of a call of the op overload;
    - a cast shared by ``fan_out`` consumers alone is made by ``runtime.shared_cast``,
      which leaves it to each consumer where autograd tracks its source (a training step
      casts per consumer, as autocast does, and no shared cast is made for nothing);
    - an exported graph's inputs are bound by indexing the forward's arguments, not by
      a ``tree_flatten_spec`` call (:func:`fxamp._torch.direct_codegen`).

    The module's own ``graph`` is unchanged: plans, passes and exports read the ops."""
    from ._torch import direct_codegen, fast_call, graph_codegen

    nested = any(n.op == "get_attr" and "." in str(n.target) for n in graph.nodes)
    fast = {n: fast_call(n.target, n.args) for n in graph.nodes if n.op == "call_function"}
    fast.update({n: (shared_cast, n.args) for n in graph.nodes if _fanned_out(n)})
    direct = direct_codegen(graph)
    if not nested and direct is None and not any(v is not None for v in fast.values()):
        return None
    new = fx.Graph()
    new.set_codegen(direct or graph_codegen(graph))
    env: dict = {}
    paths: dict = {}
    for node in graph.nodes:
        call = fast.get(node)
        if call is not None:
            call, args = call
            args, kwargs = fx.map_arg((args, node.kwargs), lambda n: env[n])
            env[node] = new.create_node("call_method" if isinstance(call, str)
                                        else "call_function", call, args, kwargs, node.name)
            env[node].meta.update(node.meta)
            continue
        if node.op != "get_attr" or "." not in str(node.target):
            env[node] = new.node_copy(node, lambda n: env[n])
            continue
        *mods, last = str(node.target).split(".")
        parent, path = None, ""
        for atom in mods:
            path = f"{path}.{atom}" if path else atom
            if path not in paths:
                name = "fxamp_m_" + path.replace(".", "_")
                paths[path] = (new.create_node("get_attr", atom, (), {}, name) if parent is None
                               else new.create_node("call_function", getattr, (parent, atom),
                                                    {}, name))
            parent = paths[path]
        env[node] = new.create_node("call_function", getattr, (parent, last), {}, node.name)
        env[node].meta.update(node.meta)
    return new


def _load(fn: Callable[..., Any], args: Tuple[Any, ...]) -> Program:
    """A pickled Program: the GraphModule torch rebuilds, made a Program again with its
    attributes (the result, the constants the graph does not name)."""
    gm = fn(*args)
    program = Program(gm, gm.graph, type(gm).__name__)
    for key, value in gm.__dict__.items():
        program.__dict__.setdefault(key, value)
    return program
