"""The example inputs are checked against the FP32 model when a rewrite fails.

A wrong shape, a missing argument or a wrong type is the user's input mistake, not a
precision problem: run the model once, as it is, and report its own error as such (instead
of what a tracer or the fake-tensor run made of it). Run only after a failure: one forward
of a large model costs about as much as its whole rewrite (ResNet-50 on CPU).
"""
from __future__ import annotations

import logging
import traceback
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
from .._torch import reparametrize_module, tree_flatten

from ..errors import ExampleInputError, is_library_file, short_path
from ..frontends.common import own_copies

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
