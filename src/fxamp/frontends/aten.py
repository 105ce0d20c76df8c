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


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """``Dim.AUTO`` for every dimension of every tensor input, keyed by parameter name."""
    from torch.export import Dim

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {i: Dim.AUTO for i in range(value.dim())} or None
        return None

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as err:
        raise TraceError(f"the example inputs do not match {type(model).__name__}.forward: "
                         f"{err}; what to do: pass example_inputs (positional) and "
                         "example_kwargs (keyword) as the forward takes them") from err
    return {name: tree_map(spec, value) for name, value in bound.arguments.items()}


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


@shows(lambda model, *a, **k: f"torch.export of {type(model).__name__}")
def _export(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
            frontend: str = "export") -> fx.GraphModule:
    try:
        shapes = _dynamic_shapes(model, args, kwargs)
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
        if _is_size(a) and _is_size(b):
            return True  # sizes do not depend on the mode (the graphs number them apart)
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
            for index, ((_, _, va), (_, _, vb)) in enumerate(zip(args_a, args_b)):
                if self.same_value(va, vb):
                    continue
                if type(va) is bool and type(vb) is bool:
                    self.changes.append((a, index, va))
                elif isinstance(va, float) and vb in (0.0, None):
                    self.changes.append((a, index, va))  # dropout p: p in train, 0 in eval
                else:
                    return False
        self.match[b] = a
        return True


def _is_size(value: Any) -> bool:
    """A node computing a symbolic size (``sym_size``, arithmetic on sizes)."""
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.SymInt)


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
        elif node.op == "call_function" and node.target in _TRAIN_ONLY_IDENTITIES:
            aligned.alias[node] = node.args[0]
        else:
            return None
    return aligned if j == len(others) else None


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


def _export_in_mode(model: nn.Module, train: bool, args: tuple,
                    kwargs: Dict[str, Any], frontend: str = "export") -> fx.GraphModule:
    with training_flags(model, train):
        return _export(model, args, kwargs, frontend)


def export_trace(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                 frontend: str = "export") -> fx.GraphModule:
    """Export ``model`` (non-strict) and return its unlifted GraphModule, following
    ``train()`` / ``eval()``; raise TraceError naming the line that stops torch.export.

    The graph is taken in the model's current mode first (its error is the one raised),
    then in the other; the train-mode graph is the base when both align."""
    args, kwargs = plain_containers((tuple(args), dict(kwargs)))
    mode = model.training
    first = _export_in_mode(model, mode, args, kwargs, frontend)
    try:
        second: Optional[fx.GraphModule] = _export_in_mode(model, not mode, args, kwargs,
                                                           frontend)
    except TraceError as err:
        log.warning("%s exports in %s mode only (%s); the rewritten graph keeps that mode's "
                    "behaviour", type(model).__name__, "train" if mode else "eval",
                    str(err).splitlines()[0])
        return first
    gm, other = (first, second) if mode else (second, first)
    aligned = _align(gm.graph, other.graph)
    if aligned is None:
        warn_one_mode(model, "exports")
        return first
    _follow_mode(gm, aligned)
    return gm


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The exported graph's placeholder values for a call ``gm(*args, **kwargs)``."""
    spec = getattr(gm, "_in_spec", None)
    if spec is None:
        return tuple(args)
    import torch.fx._pytree as fx_pytree

    value = plain_containers((tuple(args), dict(kwargs)))
    return tuple(fx_pytree.tree_flatten_spec(value, spec))


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
