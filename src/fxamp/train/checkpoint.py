"""Checkpoints of the trainer: :meth:`state_dict` / :meth:`load_state_dict` (model,
optimizer, scheduler, scaler, counters, histories, healed nodes, plan text, RNG states).

:class:`CheckpointMixin` holds these methods of :class:`fxamp.train.Trainer`.
"""
from __future__ import annotations

import collections
import warnings
from typing import Any, Dict

from ..errors import FxampError
from ..plan import Plan, diff
from .checkpoint_checks import check_checkpoint
from .localize import Overflow
from .rng import rng_state, set_rng_state


class CheckpointMixin:
    """The trainer's checkpoint methods."""

    def state_dict(self, include_model: bool = True) -> Dict[str, Any]:
        """Everything a resumed run needs to continue identically: the model's Parameters
        and buffers (unless ``include_model=False``), optimizer, scheduler, scaler,
        counters, histories, healed nodes, the plan text and the RNG states (torch CPU and
        CUDA, Python ``random``, NumPy: see :mod:`fxamp.train.rng`), so dropout draws the
        same masks after a resume. Take it where the resumed run will start."""
        if self._window:
            raise FxampError(f"state_dict() in the middle of an accumulation window "
                             f"({len(self._window)}/{self.accumulation} micro-batches); what "
                             "to do: save after a step whose StepResult.stepped is True")
        state: Dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "counters": {"micro_steps": self.micro_steps, "steps": self.steps,
                         "skipped_steps": self.skipped_steps,
                         "consecutive_overflows": self.consecutive_overflows,
                         "consecutive_skips": self.consecutive_skips},
            "history": {"scale": list(self.scale_history),
                        "grad_norm": list(self.grad_norm_history),
                        "loss": list(self.loss_history),
                        "overflows": [o.__dict__.copy() for o in self.overflows]},
            "node_overflows": dict(self.node_overflows),
            "healed": dict(self.healed),
            "plan": self.plan.to_text(),
            "rng": rng_state(),
        }
        if include_model:
            state["model"] = self.gm.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any], restore_rng: bool = True) -> None:
        """Restore :meth:`state_dict`; re-heals the saved healed nodes and warns if the
        plan then differs from the saved plan text. ``restore_rng=False`` leaves this
        process's random generators as they are.

        All or nothing: the whole checkpoint is checked first (the model's keys, shapes and
        dtypes, the optimizer's parameter groups and per-parameter state, the scaler, the
        counters and histories); a checkpoint that does not fit raises
        :class:`fxamp.errors.CheckpointError` naming what differs, with the model, optimizer
        and scaler unchanged."""
        check_checkpoint(state, self.gm, self.optimizer, self.scaler, self.scheduler)
        if state.get("healed") and state["healed"] != self.healed:
            if self.original_model is None or self.example_inputs is None:
                raise FxampError("the checkpoint has healed nodes "
                                 f"{sorted(state['healed'])}; what to do: pass original_model= "
                                 "and example_inputs= to the Trainer to restore them")
            self._rewrite_with(dict(state["healed"]))
        if "model" in state:
            self.gm.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        counters = state["counters"]
        self.micro_steps = counters["micro_steps"]
        self.steps = counters["steps"]
        self.skipped_steps = counters["skipped_steps"]
        self.consecutive_overflows = counters["consecutive_overflows"]
        self.consecutive_skips = counters.get("consecutive_skips", 0)
        history = state["history"]
        self.scale_history = list(history["scale"])
        self.grad_norm_history = list(history["grad_norm"])
        self.loss_history = list(history["loss"])
        self.overflows = [Overflow(**o) for o in history["overflows"]]
        self.node_overflows = collections.Counter(state.get("node_overflows", {}))
        self._window = []
        if restore_rng and state.get("rng") is not None:
            set_rng_state(state["rng"])
        saved, plan = state.get("plan"), self.plan
        if saved and Plan.from_text(saved).planned and plan.planned:  # (a skeleton: the
            changes = diff(Plan.from_text(saved), plan)  # blocks' plans come on a call)
            if changes:
                warnings.warn("fxamp.train: the checkpoint was made with a different plan; "
                              f"the run will not continue identically:\n{changes}")
