"""What autocast's run reads from dtypes, found without a second export where that is enough.

:mod:`.dtype_reads` exports a model a second time under ``torch.autocast`` when the FP32
graph has values that may come from a tensor's dtype. Many of those values are not dtype
reads at all, or read the same under autocast:

- a literal ``x.to(torch.float32)`` / ``x.float()`` (T5's RMSNorm, its relative-position
  buckets) is FP32 under autocast too;
- ``pos.to(h.device)`` of an embedding's output (GPT-2's position embeddings) keeps the
  embedding's FP32, which autocast leaves alone;
- ``attn.to(value.dtype)`` whose result only reaches ops autocast casts to its compute
  dtype anyway (a matmul, through a no-op dropout or a view): the ``to`` moves where the one
  rounding to that dtype happens, not what the op computes.

This module settles those without the export (2-4x the cost of a forward, a third of
a deployment plan's capture on Hugging Face models): :func:`conversions` runs the model once,
eagerly, under autocast, recording each tensor conversion the code makes (``Tensor.to``,
``float()``, ``type_as``...) with the frames of the model's code that made it and the dtype
it returned, and :func:`settled_by_run` says which conversions of the FP32 graph return the
same dtype there (matched by the stack of source lines torch.export recorded for the node).
:func:`reaches_lower_only` is the rule for the third case. Anything else (a conversion that
returns another dtype under autocast, one the run did not see, ``finfo`` constants,
factories' dtypes) is left to the export under autocast, as before.

The run is made only for the eval-mode graph of a model whose graph writes no buffer: it
changes nothing then (no running statistics, no buffer writes; the caller hands the run its
own copies of argument objects such as a KV cache).
"""
from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from .. import ops
from .._torch import FakeTensorMode, OpOverload, op_schema
from ..runtime import write_buffer_

__all__ = ["Conversion", "conversions", "fake_conversions", "settled_by_run",
           "reaches_lower_only", "writes_state"]

#: a frame: (file, line)
Frame = Tuple[str, int]
#: one conversion of the autocast run: the frames of the code that made it (outermost
#: first), the dtype of the tensor it converted and the dtype it returned
Conversion = Tuple[Tuple[Frame, ...], Optional[torch.dtype], torch.dtype]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
log = logging.getLogger(__name__)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _user_frames() -> Tuple[Frame, ...]:
    """The frames of the code running now, outermost first, less torch's and fxamp's."""
    frames: List[Frame] = []
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name.startswith(_HERE)):
            frames.append((name, frame.f_lineno))
        frame = frame.f_back
    return tuple(reversed(frames))


class _Recorder(TorchFunctionMode):
    """Records each tensor conversion call (``ops.CONVERSION_METHODS``): the dtypes in
    and out."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Conversion] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", None) in ops.CONVERSION_METHODS \
                and isinstance(out, torch.Tensor) and out.is_floating_point():
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self.seen.append((_user_frames(), None if source is None else source.dtype,
                              out.dtype))
        return out


def conversions(run: Callable[[], Any], device: str,
                compute: torch.dtype) -> Optional[List[Conversion]]:
    """Run ``run`` (one eager forward of the model) under ``torch.autocast(device, compute)``
    and no grad, and return the conversions it made; None where the run fails (the export
    under autocast decides then).

    The run is made on fake tensors first (:func:`fake_conversions`: the dtypes without the
    arithmetic, which autocast would do in ``compute`` with slow kernels on a CPU); only a
    model whose code needs its values (a branch on a tensor's value, an op without a fake
    kernel) is run on its real tensors, as before.

    Args:
        run: one eager forward of the model (on its own copies of the inputs).
        device: the autocast device type ("cpu", "cuda").
        compute: autocast's low dtype.

    Returns:
        The conversions, in the order the run made them, or None.
    """
    seen = fake_conversions(run, device, compute)
    if seen is not None:
        return seen
    recorder = _Recorder()
    try:
        with torch.no_grad(), torch.autocast(device, compute), recorder:
            run()
    except Exception:  # noqa: BLE001 - the caller falls back to the export under autocast
        return None
    return recorder.seen


def fake_conversions(run: Callable[[], Any], device: str,
                     compute: torch.dtype) -> Optional[List[Conversion]]:
    """:func:`conversions`' run on fake tensors (``FakeTensorMode``: the model's parameters,
    buffers and inputs become tensors with a dtype, a shape and a device but no data, each
    op computes only those): the same calls, in the same dtypes, with no arithmetic.

    Args:
        run: one eager forward of the model.
        device: the autocast device type.
        compute: autocast's low dtype.

    Returns:
        The conversions, or None where the forward needs real values (a branch on a
        tensor's value, an op with no fake kernel) or fails otherwise.
    """
    recorder = _Recorder()
    saved: Dict[int, Tuple[torch.nn.Module, Dict[str, Any]]] = {}

    def snapshot(module: torch.nn.Module, args: Any) -> None:
        if id(module) not in saved:
            saved[id(module)] = (module, _state_of(module))

    hook = register_module_forward_pre_hook(snapshot)
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), \
                torch.autocast(device, compute), recorder:
            run()
    except Exception as err:  # noqa: BLE001 - the real run decides then
        log.debug("the dtype probe cannot run on fake tensors (%s: %s); running it on the "
                  "real ones", type(err).__name__, str(err).splitlines()[:1])
        return None
    finally:
        hook.remove()
        for module, state in saved.values():
            _drop_fakes(module, state)
    return recorder.seen


def _state_of(module: torch.nn.Module) -> Dict[str, Any]:
    """A shallow copy of ``module``'s attributes, buffers and parameters (keyed
    ``"attr:NAME"``, ``"buffer:NAME"``, ``"param:NAME"``)."""
    state = {f"attr:{k}": v for k, v in vars(module).items()}
    state.update((f"buffer:{k}", v) for k, v in module._buffers.items())
    state.update((f"param:{k}", v) for k, v in module._parameters.items())
    return state


def _has_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor, or a list, tuple or dict holding one."""
    if isinstance(value, (list, tuple)):
        return any(_has_fake(v) for v in value)
    if isinstance(value, dict):
        return any(_has_fake(v) for v in value.values())
    return isinstance(value, torch.Tensor) and type(value).__name__ == "FakeTensor"


def _drop_fakes(module: torch.nn.Module, before: Dict[str, Any]) -> None:
    """Put back what the fake run stored on ``module`` as a fake tensor (a cache a forward
    fills, e.g. rotary tables): the value it had before, or nothing.

    Args:
        module: a module the fake run called.
        before: its :func:`_state_of` from before its first call.
    """
    places = {"attr": vars(module), "buffer": module._buffers, "param": module._parameters}
    for key, value in _state_of(module).items():
        if not _has_fake(value):
            continue
        kind, _, name = key.partition(":")
        if key in before:
            places[kind][name] = before[key]
        else:
            del places[kind][name]


def _node_frames(node: fx.Node) -> Tuple[Frame, ...]:
    """The (file, line) frames torch.export recorded for ``node``, outermost first."""
    return tuple((m["file"], int(m["line"]))
                 for m in _FRAME.finditer(node.meta.get("stack_trace") or ""))


def _within(inner: Tuple[Frame, ...], outer: Tuple[Frame, ...]) -> bool:
    """Whether the frames ``inner`` appear in ``outer`` in order (the recorded stack may
    leave frames out)."""
    it = iter(outer)
    return all(frame in it for frame in inner)


def settled_by_run(node: fx.Node, seen: List[Conversion]) -> bool:
    """Whether ``node``, a conversion of the FP32 graph, converts the same in the autocast
    run: every conversion the run made at the node's source (its recorded stack) took and
    returned the dtypes the node takes and returns in the FP32 trace, and there was at
    least one. (A no-op there is a no-op here: the uses the FP32 trace gives the
    conversion, which may be uses of the tensor itself, read the same tensor.)"""
    frames = _node_frames(node)
    out = node.meta.get("val")
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) \
        else None
    if not frames or not isinstance(out, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    found = [(a, b) for at, a, b in seen if _within(frames, at)]
    return bool(found) and all(pair == (source.dtype, out.dtype) for pair in found)


def reaches_lower_only(node: fx.Node, device: str) -> bool:
    """Whether every use of ``node``'s value reaches, through ops that pass it on unchanged
    (``ops.moves_values``, an alias, a dropout in eval), an op autocast runs in its compute
    dtype on ``device`` (its lower-precision list: matmul, linear, conv...). Such ops cast
    their inputs to that dtype, so a conversion feeding only them computes the same
    whatever dtype it converts to under autocast."""
    values, stack, seen = {node}, list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        name = ops.aten_name(user)
        if not name:
            return False
        dropout = ops.name(user) == "dropout"
        if (ops.moves_values(user) or dropout or ops.name(user) == "alias") and user.args \
                and user.args[0] in values and not any(a in values for a in user.args[1:]):
            if dropout and (len(user.args) < 3 or user.args[2] is not False):
                return False  # (a dropout in training mode scales what it keeps)
            values.add(user)
            stack.extend(user.users)
        elif ops.aten_category(name, device) != ops.LOWER:
            return False
    return bool(seen)


def writes_state(graph: fx.Graph) -> bool:
    """Whether the graph writes a module's state (a buffer write, an in-place op on a
    parameter or buffer), so an extra eager run would change the model."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is write_buffer_:
            return True
        if isinstance(node.target, OpOverload) and op_schema(node.target).is_mutable and any(
                isinstance(a, fx.Node) and a.op == "get_attr" for a in node.args):
            return True
    return False
