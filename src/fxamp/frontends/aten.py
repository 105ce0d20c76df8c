"""torch.export front end: an ATen-level graph for models ``torch.fx.symbolic_trace`` cannot take.

``torch.export.export(model, args, kwargs, strict=False)`` runs the forward once on fake
tensors, so Python control flow on shapes, dataclass outputs and keyword arguments are no
obstacle (branches on tensor *values* still are). Every tensor dimension is exported as
``Dim.AUTO``: dimensions the code does not specialise stay symbolic, so the result takes
other batch sizes and sequence lengths. The unlifted module (``ExportedProgram.module()``)
is an ordinary ``fx.GraphModule`` holding the model's own Parameters and buffers; its
``call_function`` nodes are ATen overloads, the level at which autocast's lists are defined.

Training: the export is taken in both modes. Where the graphs differ only by baked
``training`` constants (dropout, batch norm), the constants become reads of the rewritten
module's ``training`` flag, so ``train()`` / ``eval()`` work on the result; batch norm's
``num_batches_tracked += 1`` (train graph only) adds the flag itself.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import operator
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..errors import TraceError
from ..progress import shows
from .common import training_flags, warn_one_mode
from .grad_mode import RegionRefused, inline_grad_regions, refusing_inference_mode
from .fx import trace_error

log = logging.getLogger(__name__)


def _bound_inputs(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The forward's arguments by parameter name (torch.export keys dynamic_shapes so)."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as err:
        raise TraceError(f"the example inputs do not match {type(model).__name__}.forward: "
                         f"{err}; what to do: pass example_inputs (positional) and "
                         "example_kwargs (keyword) as the forward takes them") from err
    return dict(bound.arguments)


def default_dynamic_shapes(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """torch.export ``dynamic_shapes`` keeping only the dimensions that really vary between
    calls symbolic: the batch (dim 0 of every tensor input) and the sequence (dim 1 of
    integer inputs of two or more dimensions: token ids, attention masks), both as
    ``Dim.AUTO`` (export specialises them where the code needs a fixed size). Every other
    dimension is static: an all-symbolic export costs up to 20x a static one."""
    from torch.export import Dim

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        dims = {0: Dim.AUTO}
        if value.dim() >= 2 and not value.is_floating_point() and not value.is_complex() \
                and value.dtype is not torch.bool:
            dims[1] = Dim.AUTO
        return dims

    return {name: tree_map(spec, value)
            for name, value in _bound_inputs(model, args, kwargs).items()}


#: torch loggers that print whole graphs as warnings when an export fails; fxamp reports
#: the failure itself (see TraceError), so they are quietened while fxamp exports
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
                  "torch._subclasses.fake_tensor", "torch.fx.interpreter")


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Quieten those loggers, and the partial graph torch.export prints to stderr when it
    fails (kept at debug level in fxamp's log)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # (fake_tensor logs whole tracebacks at ERROR level)
        lg.setLevel(logging.CRITICAL)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if printed.getvalue():
            log.debug("torch.export printed:\n%s", printed.getvalue())


#: what to do when export fails, by the front end asked for (never advise the one in use)
_ADVICE = {
    "export": "frontend='auto' (the default) traces around the submodule that fails and "
              "runs it under torch.autocast; or remove the branch on tensor values "
              "(torch.where, torch.cond)",
    "auto": "remove the branch on tensor values (torch.where, torch.cond), or move it out "
            "of forward",
}


#: ``dynamic_shapes`` value asking for an all-static export (the other-mode graph, which
#: is only compared with the first one)
STATIC = "static"


@shows(lambda model, *a, **k: f"torch.export of {type(model).__name__}")
def _export(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
            frontend: str = "export", dynamic_shapes: Any = None) -> fx.GraphModule:
    try:
        if dynamic_shapes is None:
            shapes = default_dynamic_shapes(model, args, kwargs)
        else:
            shapes = None if dynamic_shapes is STATIC else dynamic_shapes
        with quiet_torch_logs(), refusing_inference_mode():
            program = torch.export.export(model, args, kwargs, strict=False,
                                          dynamic_shapes=shapes)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every export failure becomes a TraceError
        refused = next((e for e in (exc, exc.__cause__, exc.__context__)
                        if isinstance(e, RegionRefused)), None)
        raise trace_error(
            f"torch.export cannot export {type(model).__name__}", exc, model,
            str(refused) if refused is not None else _ADVICE.get(frontend, _ADVICE["auto"])
            ) from exc
    gm = program.module()
    _refuse_data_dependent_sizes(gm, model, frontend)
    _drop_guards(gm)
    inline_grad_regions(gm)
    return gm


def _refuse_data_dependent_sizes(gm: fx.GraphModule, model: nn.Module,
                                frontend: str = "export") -> None:
    """torch.export traces a size that depends on values (``nonzero``, boxes kept by a
    threshold) as an unbacked symbol plus asserts taken from the example; such a graph
    fails or misbehaves on other inputs, so fxamp does not use it."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        values = val if isinstance(val, (list, tuple)) else [val]
        if any(isinstance(v, (torch.SymInt, torch.Tensor)) and free_unbacked_symbols(v)
               for v in values):
            raise TraceError(
                f"torch.export cannot export {type(model).__name__} for all inputs: "
                f"{node.name} ({node.target}) has a size that depends on tensor values; the "
                "exported graph would keep assumptions from the example inputs"
                + _where(node) + "\n  what to do: " + (
                    "frontend='auto' (the default) runs it under torch.autocast or rewrites "
                    "its children" if frontend == "export" else "compute the value-dependent "
                    "sizes outside forward, or pad to a fixed size"))


def _where(node: fx.Node) -> str:
    from ..errors import source_line

    line = source_line(node)
    return f"\n  source: {line}" if line else ""


#: asserts export records on tensors' dtypes (``x.to(torch.float32)`` in the model, say):
#: the plan changes those dtypes on purpose
_METADATA_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default,)


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove export's tensor dtype asserts (the plan changes dtypes). Its input guard
    (``_guards_fn``: the shapes the graph was specialised to) stays. Subgraphs of higher-order
    ops (``wrap_with_autocast`` for a model's own ``torch.autocast`` regions) too."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in list(module.graph.nodes):
            if node.op == "call_function" and node.target in _METADATA_ASSERTS \
                    and not node.users:
                module.graph.erase_node(node)
                changed = True
        if changed:
            module.graph.lint()
            module.recompile()


def _is_batches_tracked(node: fx.Node) -> bool:
    """``bn.num_batches_tracked.add_(1)``, which only a train-mode graph has."""
    return (node.op == "call_function" and node.target is torch.ops.aten.add_.Tensor
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
            and str(node.args[0].target).endswith("num_batches_tracked"))


#: ops that only the train-mode graph may have and that change no value
_TRAIN_ONLY_IDENTITIES = (torch.ops.aten.contiguous.default, torch.ops.aten.clone.default,
                          torch.ops.aten.alias.default)


def _schema_args(node: fx.Node) -> Optional[List[Tuple[str, bool, Any]]]:
    """(name, kwarg_only, value) for every schema argument of an ATen call, defaults filled
    in; None for anything else."""
    fn = node.target
    if node.op != "call_function" or not isinstance(fn, torch._ops.OpOverload):
        return None
    out = []
    for i, arg in enumerate(fn._schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            return None
        out.append((arg.name, arg.kwarg_only, value))
    return out


class _Alignment:
    """The train-mode graph's nodes matched to the other mode's, and the constants that
    differ: ``changes`` holds (train node, argument index, train value) where the value
    must follow the training flag."""

    def __init__(self) -> None:
        self.match: Dict[fx.Node, fx.Node] = {}  # other-mode node -> train-mode node
        self.alias: Dict[fx.Node, fx.Node] = {}  # train-only identity -> its input
        self.changes: List[Tuple[fx.Node, int, Any]] = []
        self.counts: List[fx.Node] = []

    def resolve(self, node: fx.Node) -> fx.Node:
        while node in self.alias:
            node = self.alias[node]
        return node

    def same_value(self, a: Any, b: Any) -> bool:
        if _is_size(a) and (_is_size(b) or type(b) is int):
            return True  # sizes do not depend on the mode (the graphs number them apart;
            # the other-mode graph may be static: its sizes are plain ints)
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            return (isinstance(a, fx.Node) and isinstance(b, fx.Node)
                    and self.resolve(a) is self.match.get(b))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(self.same_value(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b

    def compare(self, a: fx.Node, b: fx.Node) -> bool:
        """Match ``a`` (train) with ``b``; record the constants that follow the mode."""
        if a.op != b.op or a.target != b.target:
            return False
        args_a, args_b = _schema_args(a), _schema_args(b)
        if args_a is None or args_b is None:
            if not self.same_value((a.args, a.kwargs), (b.args, b.kwargs)):
                return False
        else:
            for index, ((name, _, va), (_, _, vb)) in enumerate(zip(args_a, args_b)):
                if self.same_value(va, vb) or _same_slice_start(a, name, va, vb):
                    continue
                if type(va) is bool and type(vb) is bool:
                    self.changes.append((a, index, va))
                elif isinstance(va, float) and vb in (0.0, None):
                    self.changes.append((a, index, va))  # dropout p: p in train, 0 in eval
                else:
                    return False
        self.match[b] = a
        return True


#: shape-only nodes that a symbolic export has and a static one has not
_SHAPE_CHECKS = tuple(op for op in (
    getattr(torch.ops.aten, "_assert_scalar", None),
    getattr(torch.ops.aten, "sym_constrain_range_for_size", None),
    getattr(torch.ops.aten, "sym_constrain_range", None)) if op is not None)


def _is_size(value: Any) -> bool:
    """A node computing a symbolic size (``sym_size``, arithmetic on sizes, checks on
    them)."""
    if not isinstance(value, fx.Node):
        return False
    if isinstance(value.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return True
    target = getattr(value.target, "overloadpacket", value.target)
    return value.op == "call_function" and target in _SHAPE_CHECKS


def _is_full_slice(node: fx.Node) -> bool:
    """``x[:]`` along a symbolic dimension (``slice(x, dim, 0, INT64_MAX)``): an identity
    a symbolic export keeps and a static one drops."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    return start in (0, None) and step in (1, None) and (
        end is None or (type(end) is int and end >= 2 ** 62))


def _same_slice_start(node: fx.Node, name: str, a: Any, b: Any) -> bool:
    """``x[None:n]`` and ``x[0:n]``: a static export spells the start 0."""
    return (node.target is torch.ops.aten.slice.Tensor and name == "start"
            and a in (None, 0) and b in (None, 0) and type(a) is not bool
            and type(b) is not bool)


def _align(train: fx.Graph, other: fx.Graph) -> Optional[_Alignment]:
    """Match the train-mode graph with the other mode's; None when they differ in more
    than constants that follow the mode, identity ops and batch norm's batch count. Size
    computations are left out of the matching: the two exports order them differently."""
    aligned = _Alignment()
    others = [n for n in other.nodes if not _is_size(n)]
    j = 0
    for node in train.nodes:
        if _is_size(node):
            continue
        if j < len(others) and aligned.compare(node, others[j]):
            j += 1
        elif _is_batches_tracked(node):
            aligned.counts.append(node)
        elif node.op == "call_function" and node.target in _TRAIN_ONLY_IDENTITIES \
                or _is_full_slice(node):
            aligned.alias[node] = node.args[0]
        else:
            past = _skip_static_aliases(aligned, others, j)
            if past == j or not aligned.compare(node, others[past]):
                return None
            j = past + 1
    return aligned if j == len(others) else None


def _skip_static_aliases(aligned: _Alignment, others: List[fx.Node], j: int) -> int:
    """The index past the ``alias`` nodes at ``others[j:]`` (where a symbolic export slices
    in full, ``x[:, 0:]``, a static one has ``alias(x)``), each matched with what its input
    matched; ``j`` when there are none or only aliases are left."""
    k = j
    while k < len(others) and others[k].op == "call_function" \
            and others[k].target is torch.ops.aten.alias.default \
            and isinstance(others[k].args[0], fx.Node):
        k += 1
    if k == j or k == len(others):
        return j
    for alias in others[j:k]:
        source = aligned.match.get(alias.args[0])
        if source is not None:
            aligned.match[alias] = source
    return k


def _follow_mode(gm: fx.GraphModule, aligned: _Alignment) -> None:
    """Make the train-mode graph's mode-dependent constants read ``self.training``."""
    graph = gm.graph
    for node, index, value in aligned.changes:
        args = _schema_args(node)
        assert args is not None
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # fx: "no underlying reference"
            flag: Any = graph.get_attr("training")
            if isinstance(value, bool):
                new: Any = flag if value else graph.call_function(operator.not_, (flag,))
            else:
                new = graph.call_function(operator.mul, (value, flag))
        values = [v for _, _, v in args]
        values[index] = new
        positional = [v for (_, kw, _), v in zip(args, values) if not kw]
        keywords = {name: v for (name, kw, _), v in zip(args, values) if kw}
        node.args, node.kwargs = tuple(positional), keywords
    for node in aligned.counts:  # num_batches_tracked += training (0 in eval mode)
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flag = graph.get_attr("training")
        node.args = (node.args[0], flag)
    graph.lint()
    gm.recompile()


def _export_in_mode(model: nn.Module, train: bool, args: tuple, kwargs: Dict[str, Any],
                    frontend: str = "export", dynamic_shapes: Any = None) -> fx.GraphModule:
    with training_flags(model, train):
        return _export(model, args, kwargs, frontend, dynamic_shapes)


def export_trace(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                 frontend: str = "export", dynamic_shapes: Any = None) -> fx.GraphModule:
    """Export ``model`` (non-strict) and return its unlifted GraphModule, following
    ``train()`` / ``eval()``; raise TraceError naming the line that stops torch.export.

    ``dynamic_shapes`` (torch.export's spelling) defaults to default_dynamic_shapes: the
    batch and token-sequence dimensions symbolic, every other one static.

    A model none of whose modules reads ``training`` (see reads_training) is exported once,
    in its current mode. Otherwise the train-mode graph, exported with those dynamic shapes,
    is the base, and the eval-mode graph, exported with static shapes (it is only compared
    with the base: 2-4x cheaper), supplies the constants that follow the mode. Only where
    they do not align is a mode exported again (with the dynamic shapes)."""
    args, kwargs = plain_containers((tuple(args), dict(kwargs)))
    mode = model.training
    if not reads_training(model):
        return _export_in_mode(model, mode, args, kwargs, frontend, dynamic_shapes)
    try:
        base = _export_in_mode(model, True, args, kwargs, frontend, dynamic_shapes)
    except TraceError as err:
        if mode:
            raise  # the model's own mode: its error is the one raised
        only = _export_in_mode(model, False, args, kwargs, frontend, dynamic_shapes)
        _warn_one_mode(model, False, err)
        return only
    try:
        other = _export_in_mode(model, False, args, kwargs, frontend, STATIC)
    except TraceError as err:
        if not mode:  # an eval-mode model that exports in train mode only
            raise
        _warn_one_mode(model, True, err)
        return base
    aligned = _align(base.graph, other.graph)
    if aligned is None and not mode:
        log.debug("%s: train and static eval graphs do not align; exporting eval mode "
                  "with the dynamic shapes", type(model).__name__)
        other = _export_in_mode(model, False, args, kwargs, frontend, dynamic_shapes)
        aligned = _align(base.graph, other.graph)
        if aligned is None:
            warn_one_mode(model, "exports")
            return other
    if aligned is None:
        warn_one_mode(model, "exports")
        return base
    _follow_mode(base, aligned)
    return base


def _warn_one_mode(model: nn.Module, mode: bool, err: TraceError) -> None:
    log.warning("%s exports in %s mode only (%s); the rewritten graph keeps that mode's "
                "behaviour", type(model).__name__, "train" if mode else "eval",
                str(err).splitlines()[0])


def reads_training(model: nn.Module) -> bool:
    """Whether the code of any of ``model``'s modules may read ``training`` (so that the
    graph may depend on the mode): the source of each torch.nn class (BatchNorm, Dropout...)
    and the whole source file of every other class (its helper functions included) is
    searched for the word; a class without source counts as reading it."""
    return any(_class_reads_training(type(m)) for m in model.modules())


@functools.lru_cache(maxsize=None)
def _class_reads_training(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        try:
            if klass.__module__.startswith("torch.nn."):
                source = inspect.getsource(klass)
            else:
                module = inspect.getmodule(klass)
                source = inspect.getsource(module) if module is not None else None
        except (OSError, TypeError):
            return True
        if source is None or "training" in source:
            return True
    return False


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The exported graph's placeholder values for a call ``gm(*args, **kwargs)``."""
    spec = getattr(gm, "_in_spec", None)
    if spec is None:
        return tuple(args)
    import torch.fx._pytree as fx_pytree

    value = plain_containers((tuple(args), dict(kwargs)))
    return tuple(fx_pytree.tree_flatten_spec(value, spec))


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


class ShapeCheck:
    """A forward pre-hook raising InputShapeError when a call's input has another size on a
    dimension the export specialised (fxamp's message instead of the exported graph's
    guard), naming the input and dimension and the ``dynamic_shapes=`` that allows it."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, args: tuple,
                 kwargs: Dict[str, Any]) -> None:
        self.sizes = input_sizes(gm)
        self.model_name = type(model).__name__
        names = _input_names(model, args, kwargs)
        if len(names) == len(self.sizes):  # the forward's own names, not the graph's
            self.sizes = [(name, sizes) for name, (_, sizes) in zip(names, self.sizes)]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            flat = flat_inputs(module, args, kwargs)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - another structure: the graph's own check says so
            return None
        for (name, sizes), value in zip(self.sizes, flat):
            if sizes is None or not isinstance(value, torch.Tensor):
                continue
            if value.dim() != len(sizes):
                self._raise(name, sizes, None, value)
            for dim, size in enumerate(sizes):
                if size is not None and value.shape[dim] != size:
                    self._raise(name, sizes, dim, value)
        return None

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
        raise InputShapeError(
            f"the rewritten {self.model_name} was exported with dimension {dim} of input "
            f"{name!r} fixed at {sizes[dim]} (sizes {shown}, * = any size); this call gives "
            f"{value.shape[dim]}. By default only the batch dimension (dim 0) and the "
            "sequence dimension of integer token inputs are dynamic, and torch.export fixes "
            "a dynamic one where the model's code needs a fixed size or the example size "
            "is 0 or 1\n  what to do: rewrite with amp_rewrite(..., dynamic_shapes="
            f"{{{name!r}: {spec}}}) (torch.export's spelling, Dim from torch.export; for an "
            "input nested in a list or dict the spec follows its structure), or call it "
            f"with size {sizes[dim]}")


def _input_names(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> List[str]:
    """The forward parameter (and the path inside it) of each leaf of ``(args, kwargs)``
    in torch.export's order; [] where they cannot be told."""
    from torch.utils._pytree import keystr, tree_flatten_with_path

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


def plain_inputs_hook(_module: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """A forward pre-hook giving an exported graph its inputs with plain dicts."""
    return plain_containers(tuple(args)), plain_containers(dict(kwargs))
