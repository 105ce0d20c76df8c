"""Overflow localisation: replay a batch through a rewritten GraphModule, node by node.

The forward pass runs in a ``torch.fx.Interpreter`` that checks every node's output
for inf/NaN; a tensor hook on every node output that requires grad records, during the
(scaled) backward pass, the first node in backward order whose gradient is non-finite.
Nothing in the model changes: gradients are taken with ``torch.autograd.grad`` (no
``.grad`` is written), buffers (BatchNorm running stats) are restored and the RNG is forked.

A model rewritten in place replays the graph it computes with for the call (its mode's, its
call structure's). A model in block mode (rewritten in place without example inputs,
``rewriter/blocks.py``) replays its own code (the glue) under autocast, as it runs, on a
shadow of its module tree (``frontends/shadow.py``) whose blocks replay their graphs node
by node: a node is named ``<block path>/<node>``, as the model's plan names it. The glue's
ops (embeddings, the final norm, the head) are no graph nodes: a non-finite value they make
shows as the loss's.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from .._torch import first_child_spec, tree_flatten

from ..errors import CallStructureError, FxampError, ModeError, NotPlannedError, source_line
from ..frontends.aten_inputs import flat_inputs
from ..frontends.common import in_output_dtype
from ..frontends.shadow import Shadow
from ..graph_run import GraphRun
from .. import ir
from ..plan import Plan
from ..policy import dtype_name
from ..program import DEVICES
from ..result import RESULT, Rewritten
from ..rewriter import plan_of
from ..rewriter.inplace import INPLACE_GRAPH, InplaceForward, variant_key
from ..rewriter.overlap import is_blocks
from ..runtime import device_autocast, device_type

log = logging.getLogger(__name__)

__all__ = ["Overflow", "localize"]


@dataclass(frozen=True)
class Overflow:
    """Where a batch first produced inf/NaN in a rewritten graph; ``str(overflow)`` says it
    in one line.

    Attributes:
        phase: "forward" (a node's output is non-finite), "loss" (the model's outputs are
            finite but the loss is not), "backward" (a node's gradient, in backward order,
            became non-finite under the loss scale) or "none" (the replay stayed finite:
            the overflow did not reproduce, e.g. it came from another rank or a
            non-deterministic op).
        node: the plan node blamed (a cast node is blamed on the node it feeds).
        module: its module path.
        source: the user's source line.
        dtype: what the plan computes it in.
        op: its op label.
        forward_node: the raw graph node the forward pass found ("" if none).
        backward_node: the raw graph node the backward pass found ("" if none).
        parameter: the first parameter whose gradient is non-finite ("" if none).
        scale: the loss scale of the replay.
        step: the optimizer step of the failing batch (-1: not given).
    """

    phase: str
    node: str = ""
    module: str = ""
    source: str = ""
    dtype: Optional[torch.dtype] = None
    op: str = ""
    forward_node: str = ""
    backward_node: str = ""
    parameter: str = ""
    scale: float = 1.0
    step: int = -1

    @property
    def found(self) -> bool:
        """Whether the replay found a non-finite value."""
        return self.phase != "none"

    def __str__(self) -> str:
        if not self.found:
            return (f"overflow at step {self.step} did not reproduce in the replay "
                    f"(scale {self.scale:g})")
        where = f"node {self.node!r}" if self.node else "the loss"
        text = (f"{self.phase} overflow at step {self.step} (scale {self.scale:g}): first "
                f"non-finite value at {where}")
        if self.op:
            text += f" ({self.op}, {dtype_name(self.dtype)})"
        if self.module:
            text += f", module {self.module!r}"
        if self.source:
            text += f"\n  source: {self.source}"
        if self.parameter:
            text += f"\n  first parameter with a non-finite gradient: {self.parameter}"
        return text


def _non_finite(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_floating_point()
               and not bool(torch.isfinite(t).all()) for t in tree_flatten(value)[0])


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Every ``torch.autocast`` off while a graph is replayed (as its ``Program`` turns it
    off: the plan says each node's dtype; a block's graph is called from glue under
    autocast), back on after."""
    was = [device for device in DEVICES if torch.is_autocast_enabled(device)]
    for device in was:
        torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        for device in was:
            torch.set_autocast_enabled(device, True)


def _graph_inputs(gm: fx.GraphModule, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The placeholder values of ``gm`` for the call ``gm(*args, **kwargs)``, as its generated
    forward takes them: the call admitted by the rewrite's call structure check, bound to
    the forward's signature (keywords and defaults), flattened along its input spec.

    Args:
        gm: a rewritten graph.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.

    Raises:
        CallStructureError: the graph was not traced for this call's structure.
    """
    result = gm.__dict__.get(RESULT)
    calls = result.calls if isinstance(result, Rewritten) else None
    if calls is not None:
        args, kwargs = calls.admit(args, kwargs)
    try:
        bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    except TypeError as err:
        raise CallStructureError(
            f"the replay cannot pass this call to the rewritten graph ({err}); what to do: "
            "call the model in loss_fn as in training") from None
    bound.apply_defaults()
    names, values = list(bound.arguments), list(bound.arguments.values())
    spec = gm.__dict__.get("_in_spec")
    if spec is None:
        return tuple(values)
    first = first_child_spec(spec)
    count = first.num_children if first is not None else len(values)
    return flat_inputs(gm, tuple(values[:count]), dict(zip(names[count:], values[count:])))


class _Replay(GraphRun):
    """Runs a GraphModule node by node, noting the first non-finite output and hooking grads.

    Args:
        gm: the graph.
        path: the module path of the block it is the graph of ("": the model's).
    """

    def __init__(self, gm: fx.GraphModule, path: str = "") -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.path = path
        self.forward_bad = ""
        self.backward_bad = ""
        self.handles: List[Any] = []

    def call(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """The graph run on a call's arguments, with autocast off; its output as the
        graph's forward returns it."""
        flat = _graph_inputs(self.module, args, kwargs)  # type: ignore[arg-type]
        with _autocast_off():
            out = self.run(*flat, enable_io_processing=False)
        return self.module.graph.process_outputs(out)

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "output":
            return out
        if not self.forward_bad and _non_finite(out):
            self.forward_bad = n.name
        if n.op != "get_attr":
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                    self.handles.append(t.register_hook(self._hook(n.name)))
        return out

    def _hook(self, name: str) -> Callable[[Optional[torch.Tensor]], None]:
        def hook(grad: Optional[torch.Tensor]) -> None:
            if grad is None:  # (an output whose gradient autograd leaves undefined)
                return
            if not self.backward_bad and not bool(torch.isfinite(grad).all()):
                self.backward_bad = name
        return hook


def _graphs(module: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> List[fx.GraphModule]:
    """The graphs ``module`` may run for this call: a rewritten GraphModule itself; for a
    module rewritten in place, those planned for the call's mode, structure and floating
    input dtypes first, then its first graph, then the others."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, InplaceForward):
        return [module] if isinstance(module, fx.GraphModule) else []
    variants = forward.variants
    key = variant_key(module, args, kwargs)
    found: List[fx.GraphModule] = []
    for gm in (*variants.get(key, ()), module.__dict__.get(INPLACE_GRAPH),
               *(g for graphs in variants.values() for g in graphs)):
        if isinstance(gm, fx.GraphModule) and all(gm is not g for g in found):
            found.append(gm)
    return found


def _graph_for(module: nn.Module, label: str, args: tuple,
               kwargs: Dict[str, Any]) -> fx.GraphModule:
    """The graph ``module`` computes this call with (see :func:`_graphs`).

    Args:
        module: a rewritten GraphModule, a module rewritten in place or a block.
        label: what the errors call it.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.

    Raises:
        NotPlannedError: no graph of it was planned for this call (not called yet, or not in
            this mode or call structure).
    """
    graphs = _graphs(module, args, kwargs)
    if not graphs and not isinstance(module.__dict__.get("forward"), InplaceForward):
        raise FxampError(f"{label} was not made by fxamp.amp_rewrite as a graph; what to do: "
                         "localize the GraphModule amp_rewrite returned, or a model it "
                         "rewrote in place")
    missed: Optional[Exception] = None
    for gm in graphs:
        result = gm.__dict__.get(RESULT)
        mode = result.mode if isinstance(result, Rewritten) else None
        if mode is not None and mode is not module.training:
            continue
        try:
            _graph_inputs(gm, args, kwargs)
        except (CallStructureError, ModeError) as err:
            missed = err
            continue
        return gm
    what = "was not called yet" if not graphs else (
        f"has no graph planned for this call ({'train' if module.training else 'eval'} mode"
        + (f"; {str(missed).splitlines()[0]}" if missed is not None else "") + ")")
    raise NotPlannedError(
        f"{label} is rewritten in place and planned on its calls, and it {what}, so there is "
        "no graph of it to replay; what to do: run the model once on this batch as in "
        "training (a forward in the same mode), then localize")


class _ReplayModule:
    """Stands in for the model inside ``loss_fn`` during a replay (a rewritten GraphModule,
    or a model rewritten in place with one graph per call).

    Args:
        module: the model given to :func:`localize`.
        replays: where each call's replay is recorded.
    """

    def __init__(self, module: nn.Module, replays: List[_Replay]) -> None:
        self.module = module
        self.replays = replays
        self.training = module.training

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        gm = _graph_for(self.module, type(self.module).__name__, args, kwargs)
        replay = _Replay(gm)
        self.replays.append(replay)
        return replay.call(args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class _BlockReplay:
    """A block's ``forward`` in a block-mode replay (set on the block's shadow): the graph
    the block computes this call with, replayed node by node; a block that runs under
    autocast (past its limit of graphs) runs its own code under autocast, as it does.

    Args:
        path: the block's path in the model.
        block: the user's block (its in-place forward holds its graphs).
        shadow: the block's shadow (its own code, for a block under autocast).
        replays: where each call's replay is recorded.
    """

    def __init__(self, path: str, block: nn.Module, shadow: nn.Module,
                 replays: List[_Replay]) -> None:
        self.path, self.block, self.shadow, self.replays = path, block, shadow, replays

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.block.__dict__.get("forward")
        if isinstance(forward, InplaceForward) and forward.fallback is not None:
            policy = forward.config.policy
            with device_autocast(device_type((args, kwargs)), policy.compute):
                out = type(self.block).forward(self.shadow, *args, **kwargs)
            return in_output_dtype(out, policy.output_dtype)
        gm = _graph_for(self.block, f"block {self.path} ({type(self.block).__name__})",
                        args, kwargs)
        replay = _Replay(gm, self.path)
        self.replays.append(replay)
        return replay.call(args, kwargs)


class _BlocksReplayModule:
    """Stands in for a model in block mode inside ``loss_fn``: its own forward (the glue)
    on a shadow of it, under autocast of the plan's dtype as block mode runs it, its blocks'
    shadows replaying their graphs (:class:`_BlockReplay`).

    Args:
        model: the model in block mode.
        replays: where each block call's replay is recorded.
    """

    def __init__(self, model: nn.Module, replays: List[_Replay]) -> None:
        self.model = model
        self.root = model.__dict__["forward"]  # (its BlocksRoot: the paths, the config)
        self.shadow = Shadow(model)
        for path in self.root.paths:
            shadow = self.shadow.root.get_submodule(path)
            shadow.__dict__["forward"] = _BlockReplay(path, model.get_submodule(path), shadow,
                                                      replays)
        self.training = model.training

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.root.config.policy
        with device_autocast(device_type((args, kwargs)), policy.compute):
            out = type(self.model).forward(self.shadow.root, *args, **kwargs)
        return in_output_dtype(out, policy.output_dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _blame(gm: fx.GraphModule, plan: Plan, name: str) -> Optional[fx.Node]:
    """The plan node to blame for graph node ``name`` (casts are blamed on what they feed)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    node = nodes.get(name)
    if node is None or name in plan.nodes:
        return node
    if ir.is_cast(node) or node.op == "get_attr":
        for user in node.users:
            if user.name in plan.nodes:
                return user
        for arg in node.all_input_nodes:
            if arg.name in plan.nodes:
                return arg
    return node


@contextlib.contextmanager
def _preserved(gm: fx.GraphModule):
    """Restore buffers (BatchNorm statistics) and the RNG after a replay."""
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    devices = sorted({b.device.index for b in list(gm.parameters()) + list(gm.buffers())
                      if b.device.type == "cuda" and b.device.index is not None})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in gm.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


def localize(gm: nn.Module, loss_fn: Callable[..., torch.Tensor], *batch: Any,
             scale: float = 1.0, step: int = -1) -> Overflow:
    """Replay ``loss_fn(model, *batch)`` through ``gm`` and say where inf/NaN first appear.

    Nothing in the model changes (see the module docstring).

    Args:
        gm: a GraphModule ``amp_rewrite`` made, or a model it rewrote in place (in block
            mode too: each block's graph is replayed, its nodes named
            ``<block path>/<node>``).
        loss_fn: ``loss_fn(model, *batch) -> loss``; it gets a stand-in for ``gm`` that
            runs in a ``torch.fx.Interpreter``.
        *batch: the batch to replay.
        scale: the loss scale of the failing step: the loss is multiplied by it before
            the backward pass, so a gradient that overflowed under the scale overflows
            again.
        step: the optimizer step, recorded in the result.

    Returns:
        The ``Overflow``: the first node whose output (forward) or gradient (backward) is
        non-finite, or ``phase="none"`` when the replay stays finite.

    Raises:
        FxampError: ``gm`` was not made by ``amp_rewrite``, or ``loss_fn`` returned no
            tensor.
        NotPlannedError: a model rewritten in place (or a block of one in block mode) has
            no graph planned for the call yet: run it once on the batch first.
    """
    blocks = is_blocks(gm)
    if not blocks:
        plan_of(gm)  # (FxampError: not made by amp_rewrite)
    replays: List[_Replay] = []
    param_names: Dict[int, str] = {id(p): n for n, p in gm.named_parameters()}
    params = [p for p in gm.parameters() if p.requires_grad]
    bad_param = ""
    stand_in: Any = _BlocksReplayModule(gm, replays) if blocks else _ReplayModule(gm, replays)
    with _preserved(gm):
        try:
            loss = loss_fn(stand_in, *batch)
            if not isinstance(loss, torch.Tensor):
                raise FxampError(f"loss_fn must return a tensor, got {type(loss).__name__}")
            loss_bad = _non_finite(loss)
            if loss.requires_grad and params:
                grads = torch.autograd.grad(loss.float() * scale, params, allow_unused=True)
                for p, g in zip(params, grads):
                    if g is not None and not bool(torch.isfinite(g).all()):
                        bad_param = param_names.get(id(p), "")
                        break
        finally:
            for replay in replays:
                for handle in replay.handles:
                    handle.remove()
            if blocks:
                stand_in.shadow.release()
    forward = next((r for r in replays if r.forward_bad), None)
    backward = next((r for r in reversed(replays) if r.backward_bad), None)
    if forward is not None:
        phase, where, raw = "forward", forward, forward.forward_bad
    elif loss_bad:
        phase, where, raw = "loss", None, ""
    elif backward is not None or bad_param:
        phase, where, raw = "backward", backward, backward.backward_bad if backward else ""
    else:
        phase, where, raw = "none", None, ""
    node, entry = None, None
    if where is not None:
        graph: fx.GraphModule = where.module  # type: ignore[assignment]
        plan = plan_of(graph)
        node = _blame(graph, plan, raw)
        entry = plan.nodes.get(node.name) if node is not None else None
    prefix = _prefix(where)
    module = entry.module if entry else ""
    if where is not None and where.path and entry is not None:  # (as the model's plan says)
        module = f"{where.path}.{module}" if module else where.path
    return Overflow(phase=phase, node=f"{prefix}{node.name}" if node is not None else "",
                    module=module,
                    source=source_line(node) if node is not None else "",
                    dtype=entry.dtype if entry else None, op=entry.op if entry else "",
                    forward_node=f"{_prefix(forward)}{forward.forward_bad}" if forward else "",
                    backward_node=(f"{_prefix(backward)}{backward.backward_bad}"
                                   if backward else ""),
                    parameter=bad_param, scale=float(scale), step=step)


def _prefix(replay: Optional[_Replay]) -> str:
    """``<block path>/`` for a block's replay, "" for the model's graph."""
    return f"{replay.path}/" if replay is not None and replay.path else ""
