"""What the trainer does about non-finite gradients: the found-inf flags GradScaler recorded
(read, all-reduced across ranks, forced when the unscaled gradients are not finite), the
scale update with hysteresis and :data:`~fxamp.train.skips.SCALE_FLOOR`, and the replay of a
skipped window that names the node (see the package docstring, :mod:`fxamp.train`).

:class:`NonFiniteMixin` holds these methods of :class:`fxamp.train.Trainer`; they read the
trainer's ``scaler``, ``optimizer``, ``params``, ``scale``, ``hysteresis``, ``steps``,
``gm`` and ``_window`` and update ``consecutive_overflows`` and ``overflows``.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from .._torch import found_inf_per_device
from .localize import Overflow, localize
from .skips import SCALE_FLOOR

log = logging.getLogger("fxamp.train.trainer")  # the trainer's logger, as before the split


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class NonFiniteMixin:
    """The trainer's found-inf, scale-update and skipped-window methods."""

    def _sync_found_inf(self) -> None:
        """Make every rank see an overflow found on any rank (max all-reduce of the
        scaler's found_inf flags, what ShardedGradScaler does for FSDP). With DDP the
        all-reduced gradients already agree; this also covers gradients DDP does not
        reduce (unused parameters, params outside DDP)."""
        if not _distributed():
            return
        for found in found_inf_per_device(self.scaler, self.optimizer).values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)

    def _found_inf(self) -> bool:
        """Whether ``scaler.step`` skipped ``optimizer.step()``: the same sum over the
        optimizer's found_inf flags that ``GradScaler.step`` tests (read before update())."""
        return sum(float(v.item()) for v in
                   found_inf_per_device(self.scaler, self.optimizer).values()) > 0

    def _update_scale(self, found: bool, scale_before: float) -> None:
        if not found:
            self.consecutive_overflows = 0
            self.scaler.update()
        else:
            self.consecutive_overflows += 1
            self.scaler.update()  # GradScaler's own overflow bookkeeping: back off, reset growth
            if self.consecutive_overflows < self.hysteresis:
                # hysteresis: tolerate this overflow, keep the scale it had
                self.scaler.update(float(scale_before))
        if self.scale < SCALE_FLOOR:
            self.scaler.update(SCALE_FLOOR)

    def _non_finite(self, grad_norm: float) -> bool:
        """Whether any rank's unscaled gradients (their total norm) are not finite."""
        if not _distributed():
            return not math.isfinite(grad_norm)
        # on the parameters' device: NCCL reduces only CUDA tensors
        device = self.params[0].device if self.params else torch.device("cpu")
        flag = torch.tensor([0.0 if math.isfinite(grad_norm) else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _force_skip(self, grad_norm: float, scale: float) -> None:
        """Make ``scaler.step`` skip: GradScaler checks the scaled gradients, which can be
        finite while the unscaled ones are not (an inverse scale that overflows)."""
        log.warning("fxamp.train: step %d: the unscaled gradients are not finite (norm %s) "
                    "although GradScaler found no inf/NaN in the scaled ones (scale %g); "
                    "skipping the step", self.steps, grad_norm, scale)
        for found in found_inf_per_device(self.scaler, self.optimizer).values():
            found.fill_(1.0)

    def _localize_window(self, scale: float) -> Overflow:
        result = Overflow(phase="none", scale=scale, step=self.steps)
        for loss_fn, batch in self._window:
            result = localize(self.gm, loss_fn, *batch, scale=scale, step=self.steps)
            if result.found:
                break
        self.overflows.append(result)
        log.warning("fxamp.train: skipped step %d: %s", self.steps, result)
        return result
