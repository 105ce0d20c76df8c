"""Random number generator states for checkpoints: what a resumed run needs to draw the
same dropout masks (and data order) as the uninterrupted one.

Saved: torch's CPU generator, every CUDA device's generator (when CUDA is initialised),
Python's ``random`` and NumPy's global generator (when NumPy is importable). Everything is
stored as tensors, tuples, ints and floats, so ``torch.load(weights_only=True)`` reads it.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Dict

import torch

log = logging.getLogger(__name__)

__all__ = ["rng_state", "set_rng_state"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # NumPy is optional
        return None
    return numpy


def rng_state() -> Dict[str, Any]:
    """The current states of the torch (CPU, CUDA), Python and NumPy generators."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos),
                          int(has_gauss), float(cached))
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`. CUDA states are restored on as many devices as both the
    checkpoint and this machine have (a warning says when they differ)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda) != count:
            log.warning("the checkpoint has RNG states for %d CUDA devices, this machine %d; "
                        "restoring the first %d", len(cuda), count, min(len(cuda), count))
        for device, value in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(value, device)
    elif cuda is not None:
        log.warning("the checkpoint has CUDA RNG states but CUDA is not available here: "
                    "dropout on a GPU will not repeat the uninterrupted run")
    saved_np, np = state.get("numpy"), _numpy()
    if saved_np is not None and np is not None:
        name, keys, pos, has_gauss, cached = saved_np
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
