"""``torch.utils.checkpoint`` regions seen while a front end traces.

Both tracers run the model's forward: torch.fx on Proxies, torch.export (non-strict) on fake
tensors. Left alone, a ``checkpoint(fn, *args)`` call is traced *through*: the non-reentrant
variant's saved-tensor hooks do nothing to a graph (its ops become plain ops: checkpointing
is gone, every activation is saved), and the reentrant variant's ``CheckpointFunction`` runs
``fn`` under ``no_grad``, which torch.export records as a grad-mode region: kept as such, no
gradient reaches anything inside or before the checkpointed block (HF
``gradient_checkpointing_enable(use_reentrant=True)``: 37 of a tiny BERT's 41 parameters
got none, silently). (fx kept the reentrant ``CheckpointFunction`` as one opaque call run
under autocast: checkpointed, but its body unplanned.)

While a front end traces, :func:`recording` replaces ``torch.utils.checkpoint``'s
``_checkpoint_impl`` (which ``checkpoint``, its decorator form and ``checkpoint_sequential``
all call, whatever name the caller bound ``checkpoint`` to, as HF's ``functools.partial``
does): the function is traced inline (in the caller's grad mode) and every node it made is
tagged with its :class:`Region` (the checkpoint keywords that differ from the defaults, and
``use_reentrant``); each positional argument's node is marked with its position. The
passes plan the nodes like any others; :mod:`.checkpoint_regions` then moves each region's
rewritten nodes (casts included) into a submodule that runs under ``checkpoint`` with the
same keywords. The tags live in ``node.meta["custom"]`` (torch's key for user annotations,
which ``Graph.node_copy`` and torch.export keep), not in fxamp's IR record.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

from .._torch import checkpoint_impl, patched

log = logging.getLogger(__name__)

#: ``node.meta["custom"]`` key: the regions a node was traced in, outermost first
TAG = "fxamp_checkpoint"
#: ``node.meta["custom"]`` key: ``(region id, position)`` of each checkpoint call that
#: takes the node as a positional argument
ARGS = "fxamp_checkpoint_args"

_IDS = itertools.count()


@dataclass(eq=False)
class Region:
    """One ``checkpoint`` call seen while tracing: its keywords (``use_reentrant``...) and
    the training modes of the traces that made it (HF layers checkpoint in train mode
    only)."""

    id: int
    options: Dict[str, Any]
    modes: Set[bool] = field(default_factory=set)
    n_args: int = 0  # positional arguments that are traced values

    @property
    def reentrant(self) -> bool:
        """The reentrant variant (torch's default when ``use_reentrant`` is not given)."""
        return self.options.get("use_reentrant") is not False


def tags(node: fx.Node) -> Tuple[Region, ...]:
    """The regions ``node`` was traced in, outermost first (empty: none)."""
    return tuple(node.meta.get("custom", {}).get(TAG, ()))


def arg_marks(node: fx.Node) -> Tuple[Tuple[int, int], ...]:
    """``(region id, position)`` of the checkpoint calls taking ``node`` as an argument."""
    return tuple(node.meta.get("custom", {}).get(ARGS, ()))


def _write(node: fx.Node, key: str, value: Any) -> None:
    """A new ``custom`` dict (copies of a node share the old one)."""
    node.meta["custom"] = {**node.meta.get("custom", {}), key: value}


def copy_marks(src: fx.Node, dst: fx.Node) -> None:
    """Give ``dst`` the argument marks of ``src`` (a region's input placeholder)."""
    marks = arg_marks(src)
    if marks:
        _write(dst, ARGS, marks)


def _given(options: Dict[str, Any]) -> Dict[str, Any]:
    """The checkpoint keywords that differ from ``checkpoint``'s defaults, and
    ``use_reentrant`` always (torch.compile's checkpoint takes only a known ``context_fn``)."""
    defaults = {name: p.default for name, p in
                inspect.signature(torch_checkpoint.checkpoint).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {k: v for k, v in options.items()
            if k == "use_reentrant" or k not in defaults or not _same(v, defaults[k])}


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _created_since(graph: fx.Graph, before: Optional[fx.Node]) -> List[fx.Node]:
    """The nodes appended to ``graph`` after ``before`` (None: all), in order."""
    out: List[fx.Node] = []
    for node in reversed(graph.nodes):
        if node is before:
            break
        out.append(node)
    out.reverse()
    return out


@contextlib.contextmanager
def recording(graph_of: Callable[[], Optional[fx.Graph]],
              node_of: Callable[[Any], Optional[fx.Node]],
              mode: bool) -> Iterator[List[Region]]:
    """While the block traces: each ``checkpoint`` call runs its function inline and its
    nodes are tagged (see the module docstring). ``graph_of()`` is the graph being built
    (None: not tracing, the real checkpoint runs), ``node_of(value)`` the node of a traced
    value (None for a constant), ``mode`` the training mode of this trace. Yields the
    regions seen."""
    regions: List[Region] = []
    original = checkpoint_impl()
    if original is None:  # an older torch: checkpoint calls are traced through, as before
        log.debug("torch %s has no torch.utils.checkpoint._checkpoint_impl: checkpoint "
                  "regions are not kept", torch.__version__)
        yield regions
        return

    def traced(original: Callable, function: Callable, args: tuple, kwargs: dict,
               **options: Any) -> Any:
        graph = graph_of()
        if graph is None:
            return original(function, args, kwargs, **options)
        region = Region(next(_IDS), _given(options), {mode})
        before = next(iter(reversed(graph.nodes)), None)
        # (the arguments' nodes before the call: a no-op ``x.to(x.dtype)`` in the function,
        # HF's RMSNorm's, returns ``x`` itself, and torch.export then maps it to that node)
        given = [node_of(value) for value in args]
        result = function(*args, **kwargs)  # (inline: no no_grad of the reentrant variant)
        made = _created_since(graph, before)
        if not made:
            return result  # (nothing traced: no tensor op to checkpoint)
        for node in made:
            _write(node, TAG, (region,) + tags(node))
        for position, node in enumerate(given):
            if node is not None and node not in made:
                _write(node, ARGS, arg_marks(node) + ((region.id, position),))
                region.n_args += 1
        regions.append(region)
        log.debug("checkpoint region %d: %d nodes, %s", region.id, len(made), options)
        return result

    with patched("checkpoint_impl", traced):  # (this thread only, under the trace lock)
        yield regions


def fx_recording(tracer: fx.Tracer, mode: bool) -> "contextlib.AbstractContextManager":
    """:func:`recording` for a torch.fx symbolic trace by ``tracer``."""
    def node_of(value: Any) -> Optional[fx.Node]:
        return value.node if isinstance(value, fx.Proxy) and value.tracer is tracer else None

    return recording(lambda: getattr(tracer, "graph", None), node_of, mode)


def export_recording(mode: bool) -> "contextlib.AbstractContextManager":
    """:func:`recording` for torch.export (non-strict): the graph and the nodes of the
    fake tensors are those of the proxy mode tracing the model."""
    from torch.fx.experimental import proxy_tensor

    def graph_of() -> Optional[fx.Graph]:
        proxy_mode = proxy_tensor.get_proxy_mode()
        return None if proxy_mode is None else proxy_mode.tracer.graph

    def node_of(value: Any) -> Optional[fx.Node]:
        proxy_mode = proxy_tensor.get_proxy_mode()
        if proxy_mode is None or not isinstance(value, torch.Tensor):
            return None
        slot = proxy_tensor.get_proxy_slot(value, proxy_mode.tracer, None)
        proxy = getattr(slot, "proxy", None)
        return getattr(proxy, "node", None)

    return recording(graph_of, node_of, mode)


def aligned_pairs(aligned: Any, keep_train: bool) -> Iterator[Tuple[fx.Node, fx.Node]]:
    """(kept node, other-mode node) of each pair a :class:`.modes.Alignment` matched."""
    for eval_node, train_node in aligned.match.items():
        yield (train_node, eval_node) if keep_train else (eval_node, train_node)


def share_modes(pairs: Iterable[Tuple[fx.Node, fx.Node]]) -> int:
    """Merge the regions of two aligned traces (``(kept node, other-mode node)`` pairs): a
    region both traces made runs checkpointed in both modes; one only the other mode made
    (an HF layer checkpoints in train mode only, the model was rewritten in eval mode) is
    copied onto the kept graph, with its argument marks, and keeps its one mode. The number
    of kept nodes that got a region."""
    copied = 0
    for kept, other in pairs:
        mine, theirs = tags(kept), tags(other)
        for a, b in zip(mine, theirs):
            a.modes |= b.modes
        if theirs and not mine:
            _write(kept, TAG, theirs)
            copied += 1
        marks = tuple(m for m in arg_marks(other) if m not in arg_marks(kept))
        if marks:  # (marks of regions the kept graph has not are never read)
            _write(kept, ARGS, arg_marks(kept) + marks)
    return copied


def has_regions(graph: fx.Graph) -> bool:
    """Whether any node of ``graph`` was traced inside a checkpoint call."""
    return any(tags(node) for node in graph.nodes)


def warn_unseen(model: nn.Module, graph: fx.Graph) -> None:
    """Warn when modules of ``model`` have HF's ``gradient_checkpointing`` flag on but the
    trace made no checkpoint call (HF layers checkpoint only with grad enabled and in train
    mode): the rewritten module will not checkpoint."""
    flagged = [path for path, m in model.named_modules()
               if getattr(m, "gradient_checkpointing", False) is True]
    if flagged and not has_regions(graph):
        log.warning("%s: gradient checkpointing is enabled (%s%s) but the traced forward "
                    "made no torch.utils.checkpoint call, so the rewritten module does not "
                    "checkpoint; what to do: call amp_rewrite with grad enabled (not under "
                    "torch.no_grad()) on the model in train mode", type(model).__name__,
                    flagged[0] or type(model).__name__,
                    f" and {len(flagged) - 1} more" if len(flagged) > 1 else "")


# --- HF layers that checkpoint themselves, as children of an eager root -------------------
#
# A Hugging Face ``GradientCheckpointingLayer`` (every decoder / encoder layer in
# transformers 5.x) checkpoints in its own ``forward`` when its ``gradient_checkpointing``
# flag is on (``model.gradient_checkpointing_enable()``, which HF Trainer calls after any
# rewrite). Under an eager root the layer's rewritten module is called instead, so the
# eager front end rewrites the layer with the flag off and checkpoints the rewritten call
# itself, at run time, reading the flag and the checkpoint function the original layer
# holds (:func:`call_layer`): enabling or disabling checkpointing before or after the
# rewrite works as on the model.

#: the attributes HF's ``gradient_checkpointing_enable`` sets on a layer
LAYER_FLAGS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def is_checkpointing_layer(module: nn.Module) -> bool:
    """Whether ``module`` is an HF ``GradientCheckpointingLayer`` (it checkpoints its own
    forward when its ``gradient_checkpointing`` flag is on)."""
    return any(cls.__name__ == "GradientCheckpointingLayer"
               and cls.__module__.startswith("transformers") for cls in type(module).__mro__)


@contextlib.contextmanager
def layers_off(modules: Iterable[nn.Module]) -> Iterator[None]:
    """The ``gradient_checkpointing`` flag of each HF layer in ``modules`` off while the
    block rewrites them (their graphs get no checkpoint regions; :func:`call_layer`
    checkpoints the rewritten call), put back after."""
    saved = [(m, m.__dict__["gradient_checkpointing"]) for m in modules
             if is_checkpointing_layer(m) and "gradient_checkpointing" in m.__dict__]
    try:
        for module, _ in saved:
            module.__dict__["gradient_checkpointing"] = False
        yield
    finally:
        for module, flag in saved:
            module.__dict__["gradient_checkpointing"] = flag


def call_layer(layer: nn.Module, training: bool, run: Callable, args: tuple,
               kwargs: Dict[str, Any]) -> Any:
    """``run(*args, **kwargs)`` (the rewritten call of the HF layer ``layer``), under
    ``layer._gradient_checkpointing_func`` when ``layer`` checkpoints: its flag on, in
    training mode (``training``: the rewritten module's flag), with grad enabled. The
    cache arguments are dropped as HF's own layer drops them (``use_cache=False``, no
    ``cache`` / ``layer_past`` unless the layer may keep its cache)."""
    if not (getattr(layer, "gradient_checkpointing", False) is True and training
            and torch.is_grad_enabled()):
        return run(*args, **kwargs)
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        for name in ("cache", "layer_past"):
            if kwargs.get(name) is not None:
                kwargs[name] = None
    function = getattr(layer, "_gradient_checkpointing_func", None) or torch_checkpoint.checkpoint
    return function(functools.partial(run, **kwargs), *args)
