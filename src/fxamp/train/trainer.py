"""Trainer: one explicit optimizer step around ``torch.amp.GradScaler``.

See the package docstring (``fxamp.train``) for the step order, how a skipped step is
detected, hysteresis, healing and distributed training.

``Trainer`` keeps the step itself here; its other methods live in mixins, one topic per
module: non-finite gradients, the scale update and the skipped window (``nonfinite.py``),
healing (``healing.py``) and checkpoints (``checkpoint.py``).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import FxampError, TrainingDivergedError  # noqa: F401 - re-exported
from ..plan import Plan
from ..policy import Policy
from ..rewriter import plan_of
from .checkpoint import CheckpointMixin
from .checkpoint_checks import check_optimizer_params
from .healing import HealingMixin, healing_config
from .localize import Overflow, localize
from .nonfinite import NonFiniteMixin
from .o2 import attach_optimizer
from .skips import MAX_CONSECUTIVE_SKIPS, SCALE_FLOOR, diverged_error

log = logging.getLogger(__name__)

__all__ = ["Trainer", "StepResult", "ScaleUnderflowError", "TrainingDivergedError",
           "SCALE_FLOOR", "MAX_CONSECUTIVE_SKIPS"]

LossFn = Callable[..., torch.Tensor]



class ScaleUnderflowError(FxampError):
    """The loss scale fell below ``min_scale``: training would go on at a scale near 0."""


@dataclass(frozen=True)
class StepResult:
    """What one ``Trainer.step`` call did.

    Attributes:
        loss: the micro-batch's loss (as returned by ``loss_fn``, before any scaling).
        micro_step: how many micro-batches the trainer has run, this one included.
        step: the index of the optimizer step this micro-batch belongs to (0-based;
            skipped steps count).
        stepped: this call ended an accumulation window (an optimizer step was attempted).
        skipped: the optimizer step was skipped because a gradient was inf/NaN.
        scale: the loss scale after the update (1.0 without a scaler).
        grad_norm: total norm of the unscaled gradients (None on non-final micro-batches).
        overflow: where the overflow came from (only on skipped steps with localisation on).
        healed: the node moved to FP32 after this step ("" if none).
        grad_stats: per-parameter inf/NaN/zero gradient counts, when asked for.
    """

    loss: float
    micro_step: int
    step: int
    stepped: bool
    skipped: bool = False
    scale: float = 1.0
    grad_norm: Optional[float] = None
    overflow: Optional[Overflow] = None
    healed: str = ""
    grad_stats: Optional[Dict[str, Dict[str, int]]] = None


def _is_ddp(module: Any) -> bool:
    return isinstance(module, nn.parallel.DistributedDataParallel)


class Trainer(NonFiniteMixin, HealingMixin, CheckpointMixin):
    """Scale -> backward -> (every ``accumulation`` micro-batches) unscale_ -> clip ->
    ``scaler.step`` -> ``scaler.update`` -> ``zero_grad(set_to_none=True)`` -> scheduler.

    Args:
        model: a GraphModule made by ``fxamp.amp_rewrite``, or a
            ``DistributedDataParallel`` wrapping one.
        optimizer: an optimizer over the model's (FP32, shared) Parameters; one over another
            copy's Parameters (which would train nothing) raises FxampError.
        scaler: a ``torch.amp.GradScaler``; None makes ``GradScaler(device)``, enabled
            when the plan computes in float16 and disabled for bfloat16 (no scaling; a step whose
            gradients are non-finite is still skipped).
        accumulation: micro-batches per optimizer step; each loss is divided by it.
        clip_grad_norm: max total norm of the unscaled gradients (None: no clipping; the norm
            is still measured for the history).
        scheduler: an LR scheduler, stepped after each optimizer step that was not skipped.
        min_scale: raise ``ScaleUnderflowError`` when the scale falls below this (fp16 only:
            with the scaler disabled, e.g. bfloat16, there is no scale and passing it raises).
            Whatever it is, the scale never goes below ``SCALE_FLOOR``.
        max_consecutive_skips: raise ``TrainingDivergedError``, naming the node where the
            non-finite values start, after this many optimizer steps in a row were skipped
            (default ``MAX_CONSECUTIVE_SKIPS``; None: never). No step whose gradients are not
            all finite is ever applied, whether GradScaler noticed or not.
        hysteresis: back off the scale only on the N-th consecutive overflow (1: every overflow,
            GradScaler's own behaviour).
        localize_on_skip: replay the failing batch to name the node that overflowed (logged).
        heal: move a node to FP32 once it caused ``heal_after`` forward overflows (needs
            ``original_model`` and ``example_inputs``, the arguments of the first rewrite).
        heal_after: how many forward overflows a node may cause before ``heal`` moves it.
        heal_backward: also count backward overflows (off: those are what the loss scale is for).
        original_model: the FP32 model ``model`` was rewritten from (for ``heal``).
        example_inputs: the example inputs of that rewrite (for ``heal``).
        record_grad_stats: put per-parameter inf/NaN/zero gradient counts in every StepResult.
        tensorboard: a log directory or a SummaryWriter; scalars are written only if
            ``torch.utils.tensorboard`` imports (checked on first use).
        device: the device type the scaler works on ("cpu" or "cuda").

    Raises:
        FxampError: ``model`` was not made by ``amp_rewrite``; the optimizer holds other
            Parameters; a non-positive ``accumulation``, ``hysteresis`` or
            ``max_consecutive_skips``; ``heal`` without ``original_model`` and
            ``example_inputs``, or with DDP; ``min_scale`` with a disabled scaler.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: Optional[torch.amp.GradScaler] = None, *, accumulation: int = 1,
                 clip_grad_norm: Optional[float] = None, scheduler: Any = None,
                 min_scale: Optional[float] = None,
                 max_consecutive_skips: Optional[int] = MAX_CONSECUTIVE_SKIPS,
                 hysteresis: int = 1,
                 localize_on_skip: bool = True, heal: bool = False, heal_after: int = 2,
                 heal_backward: bool = False, original_model: Optional[nn.Module] = None,
                 example_inputs: Any = None, record_grad_stats: bool = False,
                 tensorboard: Any = None, device: str = "cpu"):
        self.module = model
        self.gm: fx.GraphModule = model.module if _is_ddp(model) else model  # type: ignore
        policy = plan_of(self.gm).policy  # raises FxampError if the model was not rewritten
        if accumulation < 1 or int(accumulation) != accumulation:
            raise FxampError(f"accumulation must be a positive integer, got {accumulation}")
        if hysteresis < 1 or int(hysteresis) != hysteresis:
            raise FxampError(f"hysteresis must be a positive integer, got {hysteresis}")
        if heal and (original_model is None or example_inputs is None):
            raise FxampError("heal=True rewrites the model again with the node in FP32; what to "
                             "do: pass original_model= and example_inputs= (as given to "
                             "fxamp.amp_rewrite)")
        if heal and _is_ddp(model):
            raise FxampError("heal=True cannot swap the module inside DistributedDataParallel; "
                             "what to do: heal in a single-process run and pass the healed "
                             "policy to amp_rewrite before wrapping in DDP")
        if max_consecutive_skips is not None and (
                max_consecutive_skips < 1 or int(max_consecutive_skips) != max_consecutive_skips):
            raise FxampError(f"max_consecutive_skips must be a positive integer or None, got "
                             f"{max_consecutive_skips}")
        if scaler is None:
            compute = Policy.parse(policy).compute
            scaler = torch.amp.GradScaler(device, enabled=compute == torch.float16)
        if min_scale is not None and not scaler.is_enabled():
            raise FxampError(
                f"min_scale={min_scale:g} has no effect: the GradScaler is disabled (the plan "
                f"computes in {Policy.parse(policy).compute}; bfloat16 has float32's range and "
                "needs no loss scaling), so there is no scale to fall\n  what to do: drop "
                "min_scale; max_consecutive_skips bounds runs of skipped (non-finite) steps")
        check_optimizer_params(self.gm, optimizer.param_groups)
        self.optimizer = optimizer
        self.scaler = scaler
        if Policy.parse(policy).weights == "o2":  # the step re-casts the weights (train/o2.py)
            attach_optimizer(lambda: self.gm, optimizer)
        self.scheduler = scheduler
        self.accumulation = int(accumulation)
        self.clip_grad_norm = clip_grad_norm
        self.min_scale = min_scale
        self.max_consecutive_skips = max_consecutive_skips
        self.hysteresis = int(hysteresis)
        self.localize_on_skip = localize_on_skip
        self.heal = heal
        self.heal_after = heal_after
        self.heal_backward = heal_backward
        self.original_model = original_model
        self.example_inputs = example_inputs
        self.record_grad_stats = record_grad_stats
        self._tensorboard = tensorboard
        self._writer: Any = None
        # what healing rewrites with (fp32:NODE overrides added): the first rewrite's config,
        # front end, example kwargs and calibration ranges included
        self._config = healing_config(self.gm, policy)
        # counters and histories (all in state_dict)
        self.micro_steps = 0          # step() calls
        self.steps = 0                # optimizer steps attempted
        self.skipped_steps = 0        # of which skipped
        self.consecutive_overflows = 0
        self.consecutive_skips = 0    # skipped optimizer steps in a row (any scaler)
        self.scale_history: List[float] = []
        self.grad_norm_history: List[float] = []
        self.loss_history: List[float] = []
        self.overflows: List[Overflow] = []
        self.node_overflows: Dict[str, int] = collections.Counter()
        self.healed: Dict[str, str] = {}
        self._window: List[Tuple[LossFn, Tuple[Any, ...]]] = []

    # ------------------------------------------------------------------ helpers
    @property
    def plan(self) -> Plan:
        """The plan of the module being trained (healed nodes have rule "heal")."""
        return plan_of(self.gm)

    @property
    def params(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def scale(self) -> float:
        """The current loss scale (1.0 when the scaler is disabled)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def grad_stats(self) -> Dict[str, Dict[str, int]]:
        """Per-parameter counts of inf, NaN and zero gradient elements (current ``.grad``).

        Returns:
            Parameter name -> ``{"inf", "nan", "zero", "numel", "none"}`` counts (``none``
            is 1 for a Parameter without a gradient).
        """
        names = {id(p): n for n, p in self.gm.named_parameters()}
        out: Dict[str, Dict[str, int]] = {}
        for i, p in enumerate(self.params):
            g = p.grad
            name = names.get(id(p), f"param{i}")
            if g is None:
                out[name] = {"inf": 0, "nan": 0, "zero": 0, "numel": p.numel(), "none": 1}
                continue
            out[name] = {"inf": int(torch.isinf(g).sum()), "nan": int(torch.isnan(g).sum()),
                         "zero": int((g == 0).sum()), "numel": g.numel(), "none": 0}
        return out

    def localize(self, loss_fn: LossFn, *batch: Any, scale: Optional[float] = None) -> Overflow:
        """Replay ``loss_fn(model, *batch)`` and say which node first goes inf/NaN, in the
        forward pass or (under the current loss scale) in the backward pass.

        Args:
            loss_fn: ``loss_fn(model, *batch) -> loss``, as given to ``step``.
            *batch: the batch to replay.
            scale: the loss scale to replay under (default: the current scale).

        Returns:
            The ``Overflow`` (``phase="none"`` when the replay stays finite).
        """
        return localize(self.gm, loss_fn, *batch, scale=self.scale if scale is None else scale,
                        step=self.steps)

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        elif grads:
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            return 0.0
        return float(norm)

    # ------------------------------------------------------------------ step
    def step(self, loss_fn: LossFn, *batch: Any) -> StepResult:
        """One micro-batch: ``loss = loss_fn(model, *batch)``, scaled backward; after every
        ``accumulation`` micro-batches, the optimizer step (see the class docstring).

        Args:
            loss_fn: ``loss_fn(model, *batch) -> loss``, a one-element tensor; ``model`` is
                the module given to the Trainer.
            *batch: the micro-batch, passed to ``loss_fn`` after the model.

        Returns:
            The ``StepResult`` (``stepped`` False before the last micro-batch of a window;
            ``skipped`` and ``overflow`` when the step was skipped).

        Raises:
            FxampError: ``loss_fn`` returned something other than a one-element tensor.
            ScaleUnderflowError: the scale fell below ``min_scale``.
            TrainingDivergedError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        self._window.append((loss_fn, batch))
        self.micro_steps += 1
        last = len(self._window) >= self.accumulation
        sync = contextlib.nullcontext() if last or not _is_ddp(self.module) \
            else self.module.no_sync()
        with sync:
            loss = loss_fn(self.module, *batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise FxampError(f"loss_fn must return a one-element tensor, got "
                                 f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
            self.scaler.scale(loss / self.accumulation).backward()
        value = float(loss.detach())
        self.loss_history.append(value)
        if not last:
            return StepResult(loss=value, micro_step=self.micro_steps, step=self.steps,
                              stepped=False, scale=self.scale)
        return self._optimizer_step(value)

    def _optimizer_step(self, loss_value: float) -> StepResult:
        enabled = self.scaler.is_enabled()
        scale_before = self.scale
        if enabled:
            self.scaler.unscale_(self.optimizer)
            self._sync_found_inf()
        grad_norm = self._grad_norm()
        stats = self.grad_stats() if self.record_grad_stats else None
        non_finite = self._non_finite(grad_norm)
        if enabled:
            if non_finite and not self._found_inf():
                self._force_skip(grad_norm, scale_before)
            self.scaler.step(self.optimizer)
            found = self._found_inf()
        else:
            found = non_finite
            if not found:
                self.optimizer.step()
        overflow = None
        self.consecutive_skips = self.consecutive_skips + 1 if found else 0
        diverged = (found and self.max_consecutive_skips is not None
                    and self.consecutive_skips >= self.max_consecutive_skips)
        if found:
            self.skipped_steps += 1
            if self.localize_on_skip or diverged:
                overflow = self._localize_window(scale_before)
        if enabled:
            self._update_scale(found, scale_before)
        if not found and self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._window = []
        step = self.steps
        self.steps += 1
        scale = self.scale
        self.scale_history.append(scale)
        self.grad_norm_history.append(grad_norm)
        healed = self._maybe_heal(overflow) if overflow is not None and self.heal else ""
        self._log_scalars(step, loss_value, scale, grad_norm, found)
        if self.min_scale is not None and enabled and scale < self.min_scale:
            last = f"; last overflow: {overflow}" if overflow is not None else ""
            raise ScaleUnderflowError(
                f"loss scale fell to {scale:g}, below min_scale={self.min_scale:g}, after "
                f"{self.consecutive_overflows} consecutive skipped steps (step {step}){last}\n"
                "  what to do: the gradients overflow at any scale; find the node with "
                "trainer.localize(loss_fn, *batch) and keep it in FP32 (policy "
                "'fp32:NODE' or heal=True), lower the learning rate, or use bfloat16")
        if diverged:
            raise diverged_error(self.consecutive_skips, step, loss_value, scale_before,
                                 overflow, self.max_consecutive_skips)
        return StepResult(loss=loss_value, micro_step=self.micro_steps, step=step,
                          stepped=True, skipped=found, scale=scale, grad_norm=grad_norm,
                          overflow=overflow, healed=healed, grad_stats=stats)

    # ------------------------------------------------------------------ telemetry
    def _log_scalars(self, step: int, loss: float, scale: float, grad_norm: float,
                     skipped: bool) -> None:
        if self._tensorboard is None:
            return
        if self._writer is None:
            if isinstance(self._tensorboard, str):
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as err:  # tensorboard is optional
                    warnings.warn(f"fxamp.train: TensorBoard logging is off ({err})")
                    self._tensorboard = None
                    return
                self._writer = SummaryWriter(self._tensorboard)
            else:
                self._writer = self._tensorboard
        for tag, value in (("loss", loss), ("loss_scale", scale), ("grad_norm", grad_norm),
                           ("skipped", float(skipped)), ("skipped_total", self.skipped_steps)):
            self._writer.add_scalar(f"fxamp/{tag}", value, step)

    def summary(self) -> str:
        """One line: steps, skips, scale, last grad norm, healed nodes."""
        norm = self.grad_norm_history[-1] if self.grad_norm_history else float("nan")
        healed = f", healed: {', '.join(self.healed)}" if self.healed else ""
        return (f"{self.steps} optimizer steps ({self.skipped_steps} skipped), scale "
                f"{self.scale:g}, grad norm {norm:.4g}{healed}")
