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
import re
import inspect
import itertools
import io
import logging
import threading
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from .. import _torch
from .._torch import PYTREE_REGISTER, tree_map

from ..errors import TraceError
from ..progress import shows
from . import calls, checkpointing, custom_functions
from .checkpoint_regions import outline
from ..graph_run import own_copies
from .common import (PACKED_ADVICE, as_tuple, packed_sequence_failure,
                     training_flags, warn_mode_only, warn_one_mode)
from .grad_mode import RegionRefused, inline_grad_regions, refusing_inference_mode
from .fx import trace_error
from .aten_inputs import (SHAPE_CHECK, ShapeCheck, batch_inputs, drop_covered_guard,
                          flat_inputs, input_names, plain_containers, plain_inputs_hook)
from .base import STATIC_SHAPES, Request, Traced
from .buffer_writes import export_write_backs
from .dtype_reads import Settled, follow_run_time_dtypes
from .hooks import hooked_modules, without_root_hooks
from .mask_skips import eager_mask_skips
from .modes import align, follow_mode, reads_training, root_flag

__all__ = ["AtenFrontend", "export_trace", "default_dynamic_shapes", "flat_inputs",
           "quiet_torch_logs"]

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
    return {name: tree_map(axes_of, value)
            for name, value in _bound_inputs(model, args, kwargs).items()}


def axes_of(value: Any) -> Any:
    """One input's dynamic axes as :func:`default_dynamic_shapes` makes them: dim 0 of a
    tensor of one or more dimensions, and dim 1 of an integer tensor of two or more (token
    ids, masks), as ``Dim.AUTO``; None for anything else.

    Args:
        value: an input (a tensor, or any other value).
    """
    from torch.export import Dim

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    dims = {0: Dim.AUTO}
    if value.dim() >= 2 and not value.is_floating_point() and not value.is_complex() \
            and value.dtype is not torch.bool:
        dims[1] = Dim.AUTO
    return dims


def call_leaves(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> List[Any]:
    """What a call gives each leaf of the forward's arguments (by parameter name, in
    torch.export's ``dynamic_shapes`` order): a tensor's shape, a Python int's value, else
    None; [] where the call does not bind to the forward.

    Args:
        model: the model called.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
    """
    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        return value if type(value) is int else None

    try:
        bound = _bound_inputs(model, args, kwargs)
    except TraceError:
        return []
    found: List[Any] = []
    _zip_specs(bound, None, lambda value, _: found.append(leaf(value)))
    return found


def grown_dimensions(first: List[Any], now: List[Any]) -> List[tuple]:
    """The (leaf, dimension) pairs where a call's leaves (:func:`call_leaves`) differ from
    the first call's: a tensor dimension of another size, or (leaf, None) for a Python int
    of another value; [] where the two do not have the same leaves and ranks.

    Args:
        first: the first call's leaves.
        now: this call's.
    """
    if len(first) != len(now):
        return []
    grown: List[tuple] = []
    for index, (a, b) in enumerate(zip(first, now)):
        if type(a) is int and type(b) is int and a != b:
            grown.append((index, None))
        elif isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
            grown.extend((index, dim) for dim, (x, y) in enumerate(zip(a, b)) if x != y)
    return grown


def grown_dynamic_shapes(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                         grown: Iterable[tuple]) -> Any:
    """:func:`default_dynamic_shapes` with every (leaf, dimension) of ``grown`` symbolic
    too (``Dim.AUTO``: torch.export specialises it where the code needs a fixed size), and
    a Python int leaf (dimension None) an input of the graph: torch.compile's automatic
    dynamic, for a module planned on its calls (``rewriter/inplace.py``).

    Args:
        model: the model about to be planned.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
        grown: the pairs made symbolic (:func:`grown_dimensions`).
    """
    from torch.export import Dim

    wanted: Dict[int, set] = {}
    for index, dim in grown:
        wanted.setdefault(index, set()).add(dim)
    counter = itertools.count()

    def spec(value: Any, default: Any) -> Any:
        dims = wanted.get(next(counter), ())
        if not dims:
            return default
        if not isinstance(value, torch.Tensor):
            return Dim.AUTO
        out = dict(default or {})
        out.update({d: Dim.AUTO for d in dims if d is not None})
        return out

    bound = _bound_inputs(model, args, kwargs)
    defaults = default_dynamic_shapes(model, args, kwargs)
    return {name: _zip_specs(value, defaults[name], spec) for name, value in bound.items()}


def _zip_specs(value: Any, default: Any, spec: Any) -> Any:
    """``spec(leaf, its default spec)`` over ``value``'s leaves (inside plain dicts, lists
    and tuples, in order), in the containers of ``default_dynamic_shapes``."""
    if type(value) is dict:
        default = default if isinstance(default, dict) else {}
        return {k: _zip_specs(v, default.get(k), spec) for k, v in value.items()}
    if type(value) in (list, tuple):
        default = default if isinstance(default, (list, tuple)) else [None] * len(value)
        return type(value)(_zip_specs(v, d, spec) for v, d in zip(value, default))
    return spec(value, default)


#: torch loggers that print whole graphs as warnings when an export fails; fxamp reports
#: the failure itself (see TraceError), so they are quietened while fxamp exports
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
                  "torch._subclasses.fake_tensor", "torch.fx.interpreter")


class _OtherThreads(logging.Filter):
    """Drops the records below CRITICAL that one thread (the tracing one) logs."""

    def __init__(self, ident: int) -> None:
        super().__init__()
        self.ident = ident

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.ident or record.levelno >= logging.CRITICAL


def _noisy_loggers() -> List[logging.Logger]:
    """Those loggers and their descendants that exist now (a filter acts on the records
    of its own logger only)."""
    names = set(_NOISY_LOGGERS) | {
        name for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
        and any(name.startswith(prefix + ".") for prefix in _NOISY_LOGGERS)}
    return [logging.getLogger(name) for name in sorted(names)]


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Quieten those loggers, and the partial graph torch.export prints to stderr when it
    fails (kept at debug level in fxamp's log), for this thread only: other threads' logs
    and stderr are untouched (holds fxamp's trace lock)."""
    with _torch.tracing():
        quiet = _OtherThreads(threading.get_ident())
        loggers = _noisy_loggers()
        for lg in loggers:  # (fake_tensor logs whole tracebacks at ERROR level)
            lg.addFilter(quiet)
        printed = io.StringIO()
        try:
            with _torch.patched("stderr", printed):
                yield
        finally:
            for lg in loggers:
                lg.removeFilter(quiet)
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


def _advice(exc: BaseException, frontend: str) -> str:
    """What to do about an export failure: an output object torch.export cannot carry (a
    Hugging Face ``DynamicCache``) has its own advice; else the front end's."""
    if packed_sequence_failure(exc):
        return PACKED_ADVICE
    found = re.search(r"Found <class '([\w.]+)'> in output", str(exc))
    if found:
        name = found.group(1).rsplit(".", 1)[-1]
        return (f"the forward returns a {name}, which torch.export cannot carry out of the "
                "graph; for a Hugging Face model pass use_cache=False in example_kwargs "
                "(or in its config), else register the class with "
                + PYTREE_REGISTER)
    return _ADVICE.get(frontend, _ADVICE["auto"])


#: ``dynamic_shapes`` value asking for an all-static export (the other-mode graph, which
#: is only compared with the first one; a deployment plan's one capture)
STATIC = STATIC_SHAPES


@shows(lambda model, *a, **k: f"torch.export of {type(model).__name__}")
def _export(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
            frontend: str = "export", dynamic_shapes: Any = None) -> fx.GraphModule:
    try:
        if dynamic_shapes is None:
            shapes = default_dynamic_shapes(model, args, kwargs)
        else:
            shapes = None if dynamic_shapes is STATIC else dynamic_shapes
        with quiet_torch_logs(), refusing_inference_mode(), eager_mask_skips(), \
                checkpointing.export_recording(model.training):
            program = torch.export.export(model, args, kwargs, strict=False,
                                          dynamic_shapes=shapes)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every export failure becomes a TraceError
        refused = next((e for e in (exc, exc.__cause__, exc.__context__)
                        if isinstance(e, RegionRefused)), None)
        raise trace_error(
            f"torch.export cannot export {type(model).__name__}", exc, model,
            str(refused) if refused is not None else _advice(exc, frontend)) from exc
    gm = program.module()
    export_write_backs(gm)
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


def _export_in_mode(model: nn.Module, train: bool, args: tuple, kwargs: Dict[str, Any],
                    frontend: str = "export", dynamic_shapes: Any = None) -> fx.GraphModule:
    with training_flags(model, train):
        return _export(model, args, kwargs, frontend, dynamic_shapes)


def _eval_run(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
    """One eager eval-mode forward of ``model`` on its own copies of argument objects (the
    run :mod:`.dtype_probe` records conversions in)."""
    with training_flags(model, False):
        model(*own_copies(args), **own_copies(kwargs))


def export_trace(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                 frontend: str = "export", dynamic_shapes: Any = None,
                 inference: bool = False,
                 compute: Optional[torch.dtype] = None,
                 settled: Optional[Settled] = None) -> fx.GraphModule:
    """Export ``model`` (non-strict) and return its unlifted GraphModule, following
    ``train()`` / ``eval()``; raise TraceError naming the line that stops torch.export, or
    the custom autograd Function whose backward the export would drop (not for
    ``inference``: see :mod:`.custom_functions`).

    ``dynamic_shapes`` (torch.export's spelling) defaults to default_dynamic_shapes: the
    batch and token-sequence dimensions symbolic, every other one static.

    A model none of whose modules reads ``training`` (see reads_training) is exported once,
    in its current mode. Otherwise the train-mode graph, exported with those dynamic shapes,
    is the base, and the eval-mode graph, exported with static shapes (it is only compared
    with the base: 2-4x cheaper), supplies the constants that follow the mode. Only where
    they do not align is a mode exported again (with the dynamic shapes). ``inference``:
    the eval-mode graph alone, exported once. ``compute``: the plan's low dtype; values the
    code reads from tensors' dtypes follow autocast's run (:mod:`.dtype_reads`) unless
    ``settled`` says the plan does without them."""
    with custom_functions.recording(model) as applied:
        gm = _export_modes(model, args, kwargs, frontend, dynamic_shapes, inference, compute,
                           settled)
    if applied and not inference:
        raise custom_functions.refusal(model, applied)
    return gm


def _export_modes(model: nn.Module, args: tuple, kwargs: Dict[str, Any], frontend: str,
                  dynamic_shapes: Any, inference: bool, compute: Optional[torch.dtype],
                  settled: Optional[Settled]) -> fx.GraphModule:
    """:func:`export_trace`'s graph, in each mode the model's code follows."""
    args, kwargs = plain_containers((tuple(args), dict(kwargs)))

    def followed(gm: fx.GraphModule, train: bool) -> fx.GraphModule:
        follow_run_time_dtypes(gm, model, args, compute, lambda: _export_in_mode(
            model, train, args, kwargs, frontend, dynamic_shapes), settled,
            None if train else lambda: _eval_run(model, args, kwargs))
        return gm

    mode = model.training
    if inference:  # (the eval-mode graph alone)
        return followed(_export_in_mode(model, False, args, kwargs, frontend,
                                        dynamic_shapes), False)
    if not reads_training(model):
        return followed(_export_in_mode(model, mode, args, kwargs, frontend, dynamic_shapes),
                        mode)
    try:
        base = _export_in_mode(model, True, args, kwargs, frontend, dynamic_shapes)
    except TraceError as err:
        if mode:
            raise  # the model's own mode: its error is the one raised
        only = _export_in_mode(model, False, args, kwargs, frontend, dynamic_shapes)
        warn_mode_only(model, only, False, err, "exports")
        return followed(only, False)
    try:
        other = _export_in_mode(model, False, args, kwargs, frontend, STATIC)
    except TraceError as err:
        if not mode:  # an eval-mode model that exports in train mode only
            raise
        warn_mode_only(model, base, True, err, "exports")
        return followed(base, True)
    aligned = align(base.graph, other.graph, (base, other))
    if aligned is None and not mode:
        log.debug("%s: train and static eval graphs do not align; exporting eval mode "
                  "with the dynamic shapes", type(model).__name__)
        other = _export_in_mode(model, False, args, kwargs, frontend, dynamic_shapes)
        aligned = align(base.graph, other.graph, (base, other))
        if aligned is None:
            warn_one_mode(model, other, False, "exports")
            return followed(other, False)
    if aligned is None:
        warn_one_mode(model, base, True, "exports")
        return followed(base, True)
    followed(base, True)  # (before the mode's constants become reads of the flag)
    follow_mode(base.graph, aligned, keep_train=True, flag_of=root_flag)
    checkpointing.share_modes(checkpointing.aligned_pairs(aligned, True))
    base.graph.lint()
    base.recompile()
    return base


def _refuse_hooks_in_export(model: nn.Module) -> None:
    """torch.export runs hooks once, at export time, on fake tensors: refused."""
    hooked = hooked_modules(model)
    if hooked:
        path, names = next(iter(hooked.items()))
        raise TraceError(
            f"torch.export would run the hooks of {type(model).__name__}.{path} ("
            f"{', '.join(names)}) once while exporting instead of on every call"
            + (f" (and {len(hooked) - 1} more hooked modules)" if len(hooked) > 1 else "")
            + "\n  what to do: frontend='fx' or 'auto' keep hooked modules as calls that run "
            "their hooks; or remove the hooks before amp_rewrite")


def _fp32_copy(value: Any) -> Any:
    """A float16 / bfloat16 tensor as FP32 (what torch.export traces in place of it)."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def _same_leaves(a: Any, b: Any) -> bool:
    """Whether two pytrees hold the same objects (no input was copied to FP32)."""
    return all(x is y for x, y in zip(_torch.tree_flatten(a)[0], _torch.tree_flatten(b)[0]))


class AtenFrontend:
    """torch.export, ATen level (see :func:`export_trace`); refuses hooked modules. The
    rewritten module checks each call's input sizes against the export's
    (:class:`.aten_inputs.ShapeCheck`) and takes OrderedDicts as dicts."""

    name = "export"
    fallback = False
    graph = True

    def capture(self, model: nn.Module, request: Request) -> Traced:
        _refuse_hooks_in_export(model)
        with without_root_hooks(model):
            try:
                gm = export_trace(model, request.args, request.kwargs, request.asked,
                                  request.dynamic_shapes, request.inference, request.compute,
                                  request.settled)
            except TraceError:
                # low-precision inputs (a child of a rewritten model, given the bf16
                # activations it gets under autocast) are exported as FP32 where they fail:
                # torch.export runs the model without autocast, where FP32 weights cannot
                # take them (a conv's FP32 bias); the graph is planned for their real dtypes
                args, kwargs = tree_map(_fp32_copy, (request.args, request.kwargs))
                if _same_leaves((args, kwargs), (request.args, request.kwargs)):
                    raise
                gm = export_trace(model, args, kwargs, request.asked,
                                  request.dynamic_shapes, request.inference, request.compute,
                                  request.settled)
        if request.dynamic_shapes is STATIC_SHAPES:  # (for ShapeCheck's message)
            gm.meta[STATIC_SHAPES] = True
        checkpointing.warn_unseen(model, gm.graph)
        if request.errors:
            log.info("torch.fx could not trace %s; torch.export took it", type(model).__name__)
        return Traced(gm, self.name, flat_inputs(gm, request.args, request.kwargs), [])

    def inputs(self, model: nn.Module, traced: Traced, args: tuple,
               kwargs: Dict[str, Any]) -> tuple:
        return flat_inputs(traced.graph_module, args, kwargs)

    def calibration(self, traced: Traced, batches: Iterable[Any]) -> Iterable[Any]:
        return [batch_inputs(traced.graph_module, as_tuple(batch), count)
                for count, batch in enumerate(batches, 1)]

    def runtime_calls(self, traced: Traced) -> List[str]:
        return []  # (hooked models are refused)

    def finish(self, gm: fx.GraphModule, traced: Traced, model: nn.Module, args: tuple,
               kwargs: Dict[str, Any]) -> Optional[calls.CallStructure]:
        outline(gm)  # checkpoint regions run under torch.utils.checkpoint again
        check = ShapeCheck(traced.graph_module, model, args, kwargs)
        gm.register_forward_pre_hook(check, with_kwargs=True)
        gm.__dict__[SHAPE_CHECK] = check
        gm.register_forward_pre_hook(plain_inputs_hook, with_kwargs=True)
        structure = calls.call_structure(gm, model, args, kwargs, values=True,
                                         symbolic=symbolic_scalars(traced.graph_module, model,
                                                                   args, kwargs))
        drop_covered_guard(gm, check, structure.scalars if structure is not None else {})
        return structure


def symbolic_scalars(gm: fx.GraphModule, model: nn.Module, args: tuple,
                     kwargs: Dict[str, Any]) -> frozenset:
    """The names of the Python scalar inputs the export kept symbolic (a ``SymInt``
    placeholder: any value runs the graph), which the call structure does not compare."""
    names = input_names(model, args, kwargs)
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    if len(names) != len(inputs):
        return frozenset()
    return frozenset(name for name, node in zip(names, inputs)
                     if isinstance(node.meta.get("val"), torch.SymInt))

