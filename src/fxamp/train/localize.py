"""Overflow localisation: replay a batch through a rewritten GraphModule, node by node.

The forward pass runs in a ``torch.fx.Interpreter`` that checks every node's output
for inf/NaN; a tensor hook on every node output that requires grad records, during the
(scaled) backward pass, the first node in backward order whose gradient is non-finite.
Nothing in the model changes: gradients are taken with ``torch.autograd.grad`` (no
``.grad`` is written), buffers (BatchNorm running stats) are restored and the RNG is forked.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx as fx
from .._torch import tree_flatten

from ..errors import FxampError, source_line
from ..graph_run import GraphRun
from .. import ir
from ..plan import Plan
from ..policy import dtype_name
from ..rewriter import plan_of

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


class _Replay(GraphRun):
    """Runs a GraphModule node by node, noting the first non-finite output and hooking grads."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.forward_bad = ""
        self.backward_bad = ""
        self.handles: List[Any] = []

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

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self.backward_bad and not bool(torch.isfinite(grad).all()):
                self.backward_bad = name
        return hook


class _ReplayModule:
    """Stands in for the model inside ``loss_fn`` during a replay."""

    def __init__(self, gm: fx.GraphModule, replays: List[_Replay]):
        self.gm = gm
        self.replays = replays
        self.training = gm.training

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            placeholders = [n.target for n in self.gm.graph.nodes if n.op == "placeholder"]
            args = args + tuple(kwargs.pop(name) for name in placeholders[len(args):]
                                if name in kwargs)
            if kwargs:
                raise FxampError(f"replay cannot pass keyword arguments {sorted(kwargs)}; "
                                 "what to do: call the model with positional arguments")
        replay = _Replay(self.gm)
        self.replays.append(replay)
        return replay.run(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gm, name)


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


def localize(gm: fx.GraphModule, loss_fn: Callable[..., torch.Tensor], *batch: Any,
             scale: float = 1.0, step: int = -1) -> Overflow:
    """Replay ``loss_fn(model, *batch)`` through ``gm`` and say where inf/NaN first appear.

    Nothing in the model changes (see the module docstring).

    Args:
        gm: a GraphModule ``amp_rewrite`` made.
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
    """
    plan = plan_of(gm)
    replays: List[_Replay] = []
    param_names: Dict[int, str] = {id(p): n for n, p in gm.named_parameters()}
    params = [p for p in gm.parameters() if p.requires_grad]
    bad_param = ""
    with _preserved(gm):
        try:
            loss = loss_fn(_ReplayModule(gm, replays), *batch)
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
    forward_bad = next((r.forward_bad for r in replays if r.forward_bad), "")
    backward_bad = next((r.backward_bad for r in reversed(replays) if r.backward_bad), "")
    if forward_bad:
        phase, raw = "forward", forward_bad
    elif loss_bad:
        phase, raw = "loss", ""
    elif backward_bad or bad_param:
        phase, raw = "backward", backward_bad
    else:
        phase, raw = "none", ""
    node = _blame(gm, plan, raw) if raw else None
    entry = plan.nodes.get(node.name) if node is not None else None
    return Overflow(phase=phase, node=node.name if node is not None else "",
                    module=entry.module if entry else "",
                    source=source_line(node) if node is not None else "",
                    dtype=entry.dtype if entry else None, op=entry.op if entry else "",
                    forward_node=forward_bad, backward_node=backward_bad,
                    parameter=bad_param, scale=float(scale), step=step)
