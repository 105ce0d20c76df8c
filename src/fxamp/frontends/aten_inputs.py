"""The inputs of a graph from torch.export: its placeholder values for a call
(:func:`flat_inputs`; :func:`batch_inputs` for a calibration batch), the sizes the export
fixed (:func:`input_sizes`) and the pre-hook that checks a call against them with fxamp's
message (:class:`ShapeCheck`), and the plain containers an exported graph's input spec
expects (:func:`plain_containers`, :func:`plain_inputs_hook`).

Both pre-hooks run on every call of an exported graph, so each has a path without pytree:
:class:`ShapeCheck` reads the inputs straight from the call along its graph's input spec
where that spec is flat (each argument a tensor or other leaf, or a list or tuple of leaves:
what a decoder layer takes), and :func:`plain_inputs_hook` gives nothing where the call
holds no dict subclass to make plain (its containers are plain lists, tuples and dicts).
Either takes the general path for anything else; both paths check and refuse alike."""
from __future__ import annotations

import copy
import inspect
import re
from operator import itemgetter
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import first_child_spec
from ..errors import CalibrationDataError, InputShapeError
from .base import STATIC_SHAPES


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The exported graph's placeholder values for a call ``gm(*args, **kwargs)``."""
    spec = getattr(gm, "_in_spec", None)
    if spec is None:
        return tuple(args)
    from .._torch import tree_flatten_spec

    value = plain_containers((tuple(args), dict(kwargs)))
    return tuple(tree_flatten_spec(value, spec))


def batch_inputs(gm: fx.GraphModule, batch: tuple, count: int) -> tuple:
    """:func:`flat_inputs` of calibration batch number ``count``; a batch with more
    positional inputs than the export took is a CalibrationDataError (the flattening would
    drop the extra ones)."""
    args_spec = first_child_spec(getattr(gm, "_in_spec", None))
    if args_spec is not None and len(batch) > args_spec.num_children:
        raise CalibrationDataError(
            f"calibration batch {count} has {len(batch)} inputs, the exported model takes "
            f"{args_spec.num_children} positional inputs\n  what to do: make every batch a "
            "tuple of the model's positional inputs with the shapes and types of "
            "example_inputs")
    return flat_inputs(gm, batch, {})


def input_sizes(gm: fx.GraphModule) -> List[Tuple[str, Optional[Tuple[Optional[int], ...]]]]:
    """(placeholder name, sizes) of each graph input: an int for a dimension the export
    fixed, None for a symbolic one; sizes None for a non-tensor input."""
    out: List[Tuple[str, Optional[Tuple[Optional[int], ...]]]] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        sizes = None
        if isinstance(val, torch.Tensor):
            sizes = tuple(s if type(s) is int else None for s in val.shape)
        out.append((node.name, sizes))
    return out


def _children(spec: Any) -> List[Any]:
    """A pytree spec's children (``TreeSpec.child`` where torch has it, else
    ``children_specs``)."""
    if hasattr(spec, "child"):
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)


#: a step of :func:`input_reads`: (0 for args, 1 for kwargs; the index or keyword; how
#: many items of a list or tuple, None for a leaf, -1 for a None the spec holds; a getter
#: of those items, for two or more)
Read = Tuple[int, Any, Optional[int], Optional[Any]]


def input_reads(spec: Any) -> Optional[Tuple[Read, ...]]:
    """How to read an exported graph's inputs (in placeholder order) straight from a call
    ``(args, kwargs)`` along its input spec, as ``tree_flatten_spec`` reads them: each
    argument a leaf, a None, or a list or tuple of leaves. None for any other spec (nested
    containers, a dict or a class of its own as an argument): read with :func:`flat_inputs`.

    Args:
        spec: the graph's ``_in_spec`` (the spec of ``(args, kwargs)``), or None.

    Returns:
        The steps, or None.
    """
    try:
        if spec is None or spec.type is not tuple or spec.num_children != 2:
            return None
        args_spec, kwargs_spec = _children(spec)
        if args_spec.type is not tuple or kwargs_spec.type is not dict:
            return None
        steps: List[Read] = []
        for where, node, keys in ((0, args_spec, range(args_spec.num_children)),
                                  (1, kwargs_spec, kwargs_spec.context)):
            for key, child in zip(keys, _children(node)):
                if child.is_leaf():
                    steps.append((where, key, None, None))
                elif child.type is type(None) and not child.num_children:
                    steps.append((where, key, -1, None))
                elif child.type in (tuple, list) and all(c.is_leaf()
                                                         for c in _children(child)):
                    n = child.num_children
                    steps.append((where, key, n, itemgetter(*range(n)) if n > 1 else None))
                else:
                    return None
    except (AttributeError, TypeError, ValueError):  # (a spec of another torch's form)
        return None
    return tuple(steps)


#: the attribute of an exported graph that holds its :class:`ShapeCheck` (a copy of the
#: graph holds the copy of it that is its hook)
SHAPE_CHECK = "_fxamp_shape_check"


def takes(gm: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> bool:
    """Whether ``gm`` takes a call of ``args`` and ``kwargs`` by the sizes it fixed: no size
    of the call differs from one its export specialised (a module with no
    :class:`ShapeCheck` takes any). A graph shared by an identical module (a block, a glue
    region) is bound to it only where it takes the call; another is planned for it.

    Args:
        gm: a rewritten module.
        args: the call's positional arguments.
        kwargs: its keyword arguments.
    """
    check = gm.__dict__.get(SHAPE_CHECK)
    if check is None:
        return True
    try:
        check(gm, args, kwargs, True)
    except InputShapeError:
        return False
    return True


def check_in_forward(gm: nn.Module) -> Optional["ShapeCheck"]:
    """Make ``gm``'s :class:`ShapeCheck` (None: it has none) run where its caller calls it
    instead of as a pre-hook: an eager root's child, whose refusal of a size is a miss
    handled inside its call (``eager._as_planned``), after its hooks ran, as they do.

    Args:
        gm: a rewritten module.
    """
    check = gm.__dict__.get(SHAPE_CHECK)
    if check is not None:
        gm.__dict__[_IN_FORWARD] = True
    return check


#: set on a module whose :class:`ShapeCheck` its forward runs (:func:`check_in_forward`)
_IN_FORWARD = "_fxamp_shape_check_in_forward"


class ShapeCheck:
    """A forward pre-hook raising InputShapeError when a call's input has another size on a
    dimension the export specialised (fxamp's message instead of the exported graph's
    guard), naming the input and dimension and the ``dynamic_shapes=`` that allows it.

    It reads the inputs along the module's input spec straight from the call where
    :func:`input_reads` can (kept with the spec it was made from), else with
    :func:`flat_inputs`; a call that does not fit the spec is not checked either way (the
    graph's own check says so)."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, args: tuple,
                 kwargs: Dict[str, Any]) -> None:
        self.sizes = input_sizes(gm)
        self.model_name = type(model).__name__
        names = input_names(model, args, kwargs)
        if len(names) == len(self.sizes):  # the forward's own names, not the graph's
            self.sizes = [(name, sizes) for name, (_, sizes) in zip(names, self.sizes)]
        self.bounds = symbolic_bounds(gm, [name for name, _ in self.sizes])
        #: every dimension fixed on purpose (a deployment plan's capture)
        self.static = bool(gm.meta.get(STATIC_SHAPES))
        #: (the input spec, :func:`input_reads` of it) of the module last checked
        self.reads: Tuple[Any, Optional[Tuple[Read, ...]]] = (None, None)

    def __deepcopy__(self, memo: dict) -> "ShapeCheck":
        """A copy (a copied Program's hook) sharing the sizes and bounds, which nothing
        changes; its reads are made from the copy's own spec."""
        new = copy.copy(self)
        new.reads = (None, None)
        memo[id(self)] = new
        return new

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict,
                 forced: bool = False) -> None:
        """Raise InputShapeError where the call has another size on a fixed dimension (see
        the class docstring). As the pre-hook, nothing where the module's forward checks
        instead (:func:`check_in_forward`); ``forced``: that forward's own check.

        Args:
            module: the exported graph called.
            args: the call's positional arguments.
            kwargs: its keyword arguments.
            forced: check even where the forward checks (its caller is that forward).
        """
        if not forced and _IN_FORWARD in module.__dict__:
            return None
        spec = module.__dict__.get("_in_spec")
        known, reads = self.reads
        if known is not spec:
            reads = input_reads(spec)
            self.reads = (spec, reads)
        try:
            if reads is None:
                flat = flat_inputs(module, args, kwargs)  # type: ignore[arg-type]
            else:
                flat = []
                for where, key, count, items in reads:
                    value = (kwargs if where else args)[key]
                    if count is None:
                        flat += (value,)
                    elif count > 1:
                        flat += items(value)
                    elif count == 1:
                        flat += (value[0],)
                    elif count < 0 and value is not None:
                        return None  # (the spec holds None here: another structure)
        except Exception:  # noqa: BLE001 - another structure: the graph's own check says so
            return None
        try:
            self._check(flat)
        except Exception as err:  # (InputShapeError: a size this graph fixed, a miss of it
            if not getattr(err, "bound", False):  # that a graph planned on it takes; not
                err.program = module  # type: ignore[attr-defined]  # a bound the code set)
            raise
        return None

    def _check(self, flat: tuple) -> None:
        """Each input's rank and fixed sizes, then the symbolic dimensions' bounds."""
        for (name, sizes), value in zip(self.sizes, flat):
            if sizes is None or not isinstance(value, torch.Tensor):
                continue
            if value.ndim != len(sizes):  # (an attribute: no call)
                self._raise(name, sizes, None, value)
            for dim, size in enumerate(sizes):
                if size is not None and value.shape[dim] != size:
                    self._raise(name, sizes, dim, value)
        if self.bounds:
            self._check_bounds(flat)

    def _check_bounds(self, flat: tuple) -> None:
        """The dynamic dimensions against the range torch.export derived for them and the
        dimensions it found equal (its ``_guards_fn`` would raise a bare AssertionError)."""
        from ..errors import InputShapeError

        seen: Dict[Any, Tuple[str, int, int]] = {}
        for index, name, dim, symbol, lower, upper in self.bounds:
            value = flat[index] if index < len(flat) else None
            if not isinstance(value, torch.Tensor) or value.dim() <= dim:
                continue
            size = value.shape[dim]
            if (upper is not None and size > upper) or (lower > 2 and size < lower):
                bound = (f"at most {upper}" if upper is not None and size > upper
                         else f"at least {lower}")
                raise _bound(InputShapeError(
                    f"the rewritten {self.model_name} was exported for input {name!r} with "
                    f"dimension {dim} of size {bound}: torch.export bounded that dimension "
                    "from what "
                    f"{self.model_name}'s code does with it on the example (a size checked "
                    "against a constant, or indexing a table such as position embeddings); "
                    f"this call gives {size}, which the graph was not traced for\n  what to "
                    f"do: call it with dimension {dim} of {name!r} of size {bound} (past "
                    "such a bound the FP32 model usually fails too: check with the model "
                    "itself); or, if the model takes such sizes, rewrite it with example "
                    "inputs of that size"))
            first = seen.setdefault(symbol, (name, dim, size))
            if first[2] != size:
                raise _bound(InputShapeError(
                    f"the rewritten {self.model_name} was exported with dimension {dim} of "
                    f"input {name!r} equal to dimension {first[1]} of input {first[0]!r} "
                    f"({self.model_name}'s code combines them on the example); this call "
                    f"gives {size} and {first[2]}\n  what to do: call it with the two of "
                    "the same size, as the model needs"))

    def _raise(self, name: str, sizes: Tuple[Optional[int], ...], dim: Optional[int],
               value: torch.Tensor) -> None:
        from ..errors import InputShapeError

        shown = "x".join("*" if s is None else str(s) for s in sizes)
        if dim is None:
            raise InputShapeError(
                f"the rewritten {self.model_name} takes input {name!r} with {len(sizes)} "
                f"dimensions ({shown}, * = any size); this call gives {value.dim()} "
                f"({tuple(value.shape)})\n  what to do: call it as it was exported, or "
                "rewrite it with example inputs of that rank")
        dims = {i for i, s in enumerate(sizes) if s is None} | {dim}
        spec = "{" + ", ".join(f"{i}: Dim.AUTO" for i in sorted(dims)) + "}"
        shapes = (f"RewriteConfig.make(dynamic_shapes={{{name!r}: {spec}}}) (torch.export's "
                  "spelling, Dim from torch.export; for an input nested in a list or dict "
                  "the spec follows its structure)")
        if sizes[dim] <= 1:  # torch.export fixes it whatever dynamic_shapes says
            fix = (f"rewrite with example inputs whose dimension {dim} of {name!r} has size "
                   "2 or more (torch.export fixes a dimension whose example size is 0 or 1, "
                   "even one dynamic_shapes calls dynamic; a graph traced on size 2 takes "
                   "size 1 too where the model's code allows it)"
                   + ("" if dim == 0 else f" and with {shapes}"))
        else:
            fix = f"rewrite with {shapes}"
        why = ("A deployment plan (target='tensorrt') is exported for the example's sizes, "
               "as export_onnx writes the file, unless dynamic_shapes or calibration_data "
               "say otherwise" if self.static else
               "By default only the batch dimension (dim 0) and the "
               "sequence dimension of integer token inputs are dynamic, and torch.export fixes "
               "a dynamic one where the model's code needs a fixed size or the example size "
               "is 0 or 1")
        raise InputShapeError(
            f"the rewritten {self.model_name} was exported with dimension {dim} of input "
            f"{name!r} fixed at {sizes[dim]} (sizes {shown}, * = any size); this call gives "
            f"{value.shape[dim]}. {why}\n  what to do: {fix}, or call it with size "
            f"{sizes[dim]}")


def _bound(err: Exception) -> Exception:
    """``err`` marked as a bound the model's code set (not a size the export fixed): no
    graph planned on the call would take it, so it is raised, not planned for."""
    err.bound = True  # type: ignore[attr-defined]
    return err


def symbolic_bounds(gm: fx.GraphModule, names: List[str]
                    ) -> List[Tuple[int, str, int, Any, int, Optional[int]]]:
    """(input index, name, dimension, symbol, lower, upper) of each dynamic dimension of
    the exported graph's inputs that torch.export's input guard checks: a range narrower
    than its default (an upper bound, or a lower one above 2) or a symbol two dimensions
    share (the dimensions must be equal). ``names``: each input's name, in graph order."""
    from .._torch import size_range

    found: List[Tuple[int, str, int, Any, int, Optional[int]]] = []
    count: Dict[Any, int] = {}
    for index, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for dim, size in enumerate(val.shape):
            bounds = size_range(size)
            if bounds is not None:
                name = names[index] if index < len(names) else node.name
                found.append((index, name, dim) + bounds)
                count[bounds[0]] = count.get(bounds[0], 0) + 1
    return [b for b in found
            if b[5] is not None or b[4] > 2 or count[b[3]] > 1]


def input_names(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> List[str]:
    """The forward parameter (and the path inside it) of each leaf of ``(args, kwargs)``
    in torch.export's order; [] where they cannot be told."""
    from .._torch import keystr, tree_flatten_with_path

    try:
        params = list(inspect.signature(model.forward).parameters)
        leaves, _ = tree_flatten_with_path(plain_containers((tuple(args), dict(kwargs))))
    except (TypeError, ValueError):
        return []
    names = []
    for path, _ in leaves:
        where, key = path[0], path[1]
        index = getattr(key, "idx", None)
        top = (params[index] if where.idx == 0 and index is not None and index < len(params)
               else str(getattr(key, "key", key)))
        names.append(top + keystr(path[2:]))
    return names


def plain_containers(value: Any) -> Any:
    """``value`` with every OrderedDict made a dict: an exported graph's input spec tells
    the two apart, while models hand either (an fx graph returns a dict where the traced
    code built an OrderedDict)."""
    if isinstance(value, dict):
        return {k: plain_containers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(plain_containers(v) for v in value)
    return value


#: the types :func:`plain_containers` gives back as they are (exactly these: a subclass
#: takes the general path)
_LEAVES = frozenset({torch.Tensor, nn.Parameter, type(None), bool, int, float, str})


def _plain(values: Iterable[Any]) -> bool:
    """Whether :func:`plain_containers` would give each of ``values`` back alike: a leaf
    of :data:`_LEAVES`, or a plain list, tuple or dict of such (at any depth)."""
    for value in values:
        kind = type(value)
        if kind in _LEAVES:
            continue
        if kind is tuple or kind is list:
            if _plain(value):
                continue
        elif kind is dict and _plain(value.values()):
            continue
        return False
    return True


#: a guard on one input dimension's size (``position_embeddings[0].size()[1] == 32``), and
#: on one Python value (``use_cache == False``), as torch.export's guard messages spell them
_SIZE_GUARD = re.compile(r"^(?P<name>[\w.\[\]'\"]+)\.size\(\)\[(?P<dim>\d+)\] == (?P<size>\d+)$")
_VALUE_GUARD = re.compile(r"^(?P<name>\w+) == (?P<value>.+)$")


def drop_covered_guard(gm: fx.GraphModule, check: ShapeCheck, scalars: Dict[str, Any]) -> bool:
    """Remove the exported graph's own input guard (its ``_guards_fn`` call) where every
    condition it asserts is checked before the graph already: a size ``check`` fixes, or a
    Python value the call structure compares (``scalars``: the values the graph fixed, by
    name). The guard is a module call behind a torch.compile config patch with one
    ``torch._assert`` per condition, run on every call: dozens of Python calls a block,
    each a repeat of fxamp's own checks. A guard with any other condition stays whole.

    Args:
        gm: the exported graph module, after ``check`` is registered on it.
        check: its input shape check.
        scalars: the Python scalars its call structure compares, by name.

    Returns:
        Whether the guard was removed.
    """
    from .._torch import INPUT_GUARD, input_guard_conditions, is_input_guard

    conditions = input_guard_conditions(gm)
    if conditions is None:
        return False
    sizes = {name: dims for name, dims in check.sizes if dims is not None}
    for condition in conditions:
        size = _SIZE_GUARD.match(condition)
        if size is not None:
            dims, dim = sizes.get(size["name"]), int(size["dim"])
            if dims is not None and dim < len(dims) and dims[dim] == int(size["size"]):
                continue
            return False
        value = _VALUE_GUARD.match(condition)
        if value is None or value["name"] not in scalars \
                or repr(scalars[value["name"]]) != value["value"]:
            return False
    nodes = [n for n in gm.graph.nodes if is_input_guard(n)]
    if len(nodes) != 1 or nodes[0].users:
        return False
    gm.graph.erase_node(nodes[0])
    delattr(gm, INPUT_GUARD)
    gm.recompile()
    return True


def plain_inputs_hook(_module: nn.Module, args: tuple, kwargs: dict
                      ) -> Optional[Tuple[tuple, dict]]:
    """A forward pre-hook giving an exported graph its inputs with plain dicts (None, the
    call as it is, where it holds no container to make plain)."""
    if _plain(args) and _plain(kwargs.values()):
        return None
    return plain_containers(tuple(args)), plain_containers(dict(kwargs))
