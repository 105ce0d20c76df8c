"""The example inputs are checked against the FP32 model before anything is traced.

A wrong shape, a missing argument or a wrong type is the user's input mistake, not a
precision problem: run the model once, as it is, and report its own error as such (before a
tracer or the fake-tensor run turns it into something else).
"""
from __future__ import annotations

import logging
import traceback
from typing import Any, Dict

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten

from ..errors import ExampleInputError, is_library_file, short_path

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


def check_example_inputs(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
    """Run ``model`` in FP32 on the example inputs (no grad, on copies of its buffers, with
    a forked RNG, autocast off); raise ExampleInputError with the model's own message if it
    fails. Skipped for models or inputs on the meta device (nothing can run there)."""
    if _on_meta(model, args, kwargs):
        log.debug("example inputs not checked: meta tensors")
        return
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    devices = sorted({t.device.type for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)} | {"cpu"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                _reparametrize_module(model, buffers, strict=False):
            with _autocast_off(devices):
                model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the model's own failure, reported as such
        text = str(exc).strip()
        msg = (f"{type(model).__name__} fails in FP32 on the example inputs, before any "
               f"precision change: {type(exc).__name__}: "
               f"{text.splitlines()[0] if text else ''}")
        where = _user_frame(exc)
        if where:
            msg += f"\n  source: {where}"
        shapes = ", ".join(_describe(a) for a in args) or "none"
        msg += (f"\n  example inputs: ({shapes})"
                "\n  what to do: pass example_inputs (a tuple of the forward's positional "
                "arguments, example_kwargs for keyword ones) with which model(*example_inputs) "
                "runs")
        raise ExampleInputError(msg) from exc


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


class _autocast_off:
    """Autocast disabled on every device type the inputs use (the FP32 model)."""

    def __init__(self, devices: list) -> None:
        self.contexts = [torch.autocast(d, enabled=False) for d in devices
                         if d in ("cpu", "cuda", "xpu", "mps", "hpu")]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)
