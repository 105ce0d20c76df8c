"""What ``amp_rewrite`` is given: a module it can take (:func:`check_model`), and example
inputs, checked against the FP32 model when a rewrite fails.

A wrong shape, a missing argument or a wrong type is the user's input mistake, not a
precision problem: run the model once, as it is, and report its own error as such (instead
of what a tracer or the fake-tensor run made of it). Run only after a failure: one forward
of a large model costs about as much as its whole rewrite (ResNet-50 on CPU).
"""
from __future__ import annotations

import logging
import traceback
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn
from .._torch import reparametrize_module, tree_flatten

from ..errors import (ExampleInputError, UnsupportedModelError, is_library_file,
                      short_path)
from ..graph_run import own_copies
from ..frontends.model_checks import check_parameter_dtypes
from ..structure import inside
from .inplace import is_fully_sharded

log = logging.getLogger(__name__)


def _on_meta(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> bool:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    tensors += list(model.parameters()) + list(model.buffers())
    return any(t.device.type == "meta" for t in tensors)


def _user_frame(exc: BaseException) -> str:
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not is_library_file(frame.filename):
            return (f'File "{short_path(frame.filename)}", line {frame.lineno}, in '
                    f'{frame.name}: {frame.line}')
    return ""


def _run(model: nn.Module, args: tuple, kwargs: Dict[str, Any], grad: bool,
         autocast: Any) -> None:
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with torch.set_grad_enabled(grad), torch.random.fork_rng(devices=[]), \
            reparametrize_module(model, buffers, strict=False), autocast:
        model(*own_copies(tuple(args)), **own_copies(dict(kwargs)))  # (caches stay as given)


def check_example_inputs(model: nn.Module, args: tuple, kwargs: Dict[str, Any],
                         low: torch.dtype = torch.float16) -> Optional[ExampleInputError]:
    """Run ``model`` in FP32 on the example inputs (no grad, on copies of its buffers, with
    a forked RNG, autocast off). If it fails, and fails too under ``torch.autocast``
    (``low``, for inputs already in low precision) and with grad enabled (a forward that
    differentiates inside), return an ExampleInputError with the model's own message.
    None when it runs, or for models or inputs on the meta device (nothing can run
    there)."""
    if _on_meta(model, args, kwargs):
        log.debug("example inputs not checked: meta tensors")
        return None
    devices = sorted({t.device.type for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)} | {"cpu"})
    device = next((d for d in devices if d != "cpu"), "cpu")
    try:
        _run(model, args, kwargs, False, AutocastOff(devices))
        return None
    except Exception as exc:  # noqa: BLE001 - the model's own failure, reported as such
        first = exc
    for grad, autocast in ((False, torch.autocast(device, dtype=low)),
                           (True, AutocastOff(devices))):
        try:
            _run(model, args, kwargs, grad, autocast)
            return None
        except Exception:  # noqa: BLE001 - the first failure is the one reported
            pass
    exc = first
    text = str(exc).strip()
    msg = (f"{type(model).__name__} fails on the example inputs, in FP32 and under "
           f"torch.autocast, before any precision change: {type(exc).__name__}: "
           f"{text.splitlines()[0] if text else ''}")
    where = _user_frame(exc)
    if where:
        msg += f"\n  source: {where}"
    shapes = ", ".join(_describe(a) for a in args) or "none"
    msg += (f"\n  example inputs: ({shapes})"
            "\n  what to do: pass example_inputs (a tuple of the forward's positional "
            "arguments, example_kwargs for keyword ones) with which model(*example_inputs) "
            "runs")
    error = ExampleInputError(msg)
    error.__cause__ = exc
    log.debug("the model fails on the example inputs: %s", msg)
    return error


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


class AutocastOff:
    """Autocast disabled on each of ``devices`` for the block (the FP32 model's run, an
    in-place model planned again inside a call), and its cast cache off: inside a user's
    autocast region the cache outlives the block, and a run on fake tensors there (the
    planning's, under autocast) would leave fake casts of real Parameters in it for the
    user's next ops. Restored on every exit path."""

    def __init__(self, devices: list) -> None:
        self.contexts = [torch.autocast(d, enabled=False, cache_enabled=False) for d in devices
                         if d in ("cpu", "cuda", "xpu", "mps", "hpu")]

    def __enter__(self) -> None:
        for c in self.contexts:  # (each puts the cache setting back on exit)
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


#: forwards that only defer to ``nn.Module``'s (which raises NotImplementedError)
_NO_FORWARD = ("LightningModule.forward",)


def check_module(model: Any) -> None:
    """Refuse anything but an ``nn.Module``, naming what it is.

    Args:
        model: what amp_rewrite was given.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"amp_rewrite takes a torch.nn.Module, got {type(model).__name__}; "
            "what to do: wrap the callable in an nn.Module")
    forward = type(model).forward
    if forward is nn.Module.forward or getattr(forward, "__qualname__", "") in _NO_FORWARD:
        # (a LightningModule's steps call its submodules, never its own forward: rewriting
        # it would change nothing, silently)
        name = type(model).__name__
        children = [f"{path} ({type(m).__name__})" for path, m in model.named_children()
                    if type(m).forward is not nn.Module.forward]
        first = children[0].split(" ")[0] if children else "net"
        raise UnsupportedModelError(
            f"{name} has no forward of its own (it inherits "
            f"{getattr(forward, '__qualname__', 'nn.Module.forward')}, which raises "
            f"NotImplementedError), so its training and validation steps call its "
            f"submodules, and a rewrite of {name} would change nothing they compute. what "
            f"to do: rewrite the submodule the steps call, e.g. "
            f"fxamp.amp_rewrite(module.{first}, config=..., inplace=True)"
            + (f"; its submodules with a forward: {', '.join(children[:6])}"
               if children else ""))


def check_model(model: Any, sharded_ok: bool = False, calls: Sequence[str] = ()) -> None:
    """Refuse what amp_rewrite cannot take, naming it.

    Args:
        model: what amp_rewrite was given.
        sharded_ok: FSDP2's ``fully_shard`` may have been applied to the model itself (an
            in-place model or block planned on a call: FSDP2's hooks have gathered the
            parameters this call computes with); not to a submodule, whose hooks its graph
            would not call.
        calls: submodules the graph calls as modules (block mode's regions, planned
            with the glue): their hooks run, so they and what is inside them may be
            sharded.
    """
    check_module(model)
    sharded = next((path for path, m in model.named_modules()
                    if is_fully_sharded(m) and (path or not sharded_ok)
                    and path not in calls and not inside(path, calls)), None)
    if sharded is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__}{f' ({sharded})' if sharded else ''} is already sharded "
            "by FSDP2's fully_shard: its parameters are DTensors gathered by module hooks "
            "that a rewritten graph does not call. what to do: rewrite first, in place, "
            "then shard: amp_rewrite(model, config=..., inplace=True) (with or without "
            "an example: each layer stays a module), then fully_shard each layer and the "
            "root; or, one graph of the whole model (an example and partition='flat'), "
            "fully_shard(model) on the root alone")
    check_parameter_dtypes(model)  # (names FSDP2's MixedPrecisionPolicy where it is why)
