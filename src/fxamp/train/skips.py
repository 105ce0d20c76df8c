"""The trainer's skip policy: the loss-scale floor, the limit on consecutive skipped steps,
and the error raised when it is reached. See ``fxamp.train`` ("No non-finite step is
applied")."""
from __future__ import annotations

from typing import Optional

from ..errors import TrainingDivergedError
from .localize import Overflow

__all__ = ["SCALE_FLOOR", "MAX_CONSECUTIVE_SKIPS", "diverged_error"]

#: The loss scale never goes below this (a power of two, 40 halvings below GradScaler's
#: default start of 2**16): far below any scale that helps, while the scaled loss stays a
#: normal float32 and the inverse scale (2**24) finite. Without it a long run of overflows
#: takes the scale to ~1e-44, whose inverse is inf: unscaled gradients become inf/NaN that
#: GradScaler (which checks the *scaled* gradients) does not see, and the scale can reach 0,
#: from which it never grows back.
SCALE_FLOOR = 2.0 ** -24

#: Default of ``Trainer(max_consecutive_skips=...)``. From the default start (2**16) a
#: GradScaler needs ~16-24 consecutive skips to find a workable fp16 scale for gradients
#: that are large at the start; 50 is twice that plus margin (the scale is then 2**-24, the
#: floor): a longer run is not a scale problem but NaN/inf in the forward pass, the data or
#: a diverged model.
MAX_CONSECUTIVE_SKIPS = 50


def diverged_error(n: int, step: int, loss: float, scale: float, overflow: Optional[Overflow],
                   limit: Optional[int]) -> TrainingDivergedError:
    """The error for ``n`` skipped steps in a row ending at ``step``: where the non-finite
    values start (``overflow``, localised on the last batch) and what to do."""
    where = str(overflow) if overflow is not None else "not localised"
    since = f"step {step - n}" if step >= n else "the start"
    if overflow is not None and overflow.phase in ("forward", "loss"):
        fix = ("the values are non-finite before any loss scaling: check the data and the "
               "loss near that node (NaN/inf inputs or labels, log/sqrt of 0, division by "
               "0), or keep the node in FP32 (policy 'fp32:NODE' or heal=True)")
    else:
        fix = ("lower the learning rate or clip gradients (clip_grad_norm=), keep the "
               "node in FP32 (policy 'fp32:NODE' or heal=True), or use bfloat16")
    return TrainingDivergedError(
        f"{n} optimizer steps in a row were skipped (steps {step - n + 1}-{step}): the "
        f"gradients were not finite at each (last loss {loss:g}, scale {scale:g}); the "
        f"weights are unchanged since {since}\n  where it starts: {where}\n"
        f"  what to do: {fix}; if long runs of skipped steps are expected, raise "
        f"max_consecutive_skips (now {limit}; None never raises)")
