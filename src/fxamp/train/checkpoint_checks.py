"""What a trainer checks before it loads a checkpoint or trains with an optimizer.

:func:`check_checkpoint` validates a whole :meth:`Trainer.state_dict` (the model's keys,
shapes and dtypes, the optimizer's parameter groups and per-parameter state, the scaler, the
counters, histories, plan text and RNG states) against the trainer, so that
``load_state_dict`` either loads everything or changes nothing. :func:`check_optimizer_params`
refuses an optimizer that would not train the rewritten model.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Sequence

import torch
import torch.nn as nn

from ..errors import CheckpointError, FxampError

__all__ = ["TRAINER_KEYS", "check_checkpoint", "check_optimizer_params"]

#: The keys of :meth:`Trainer.state_dict` that every checkpoint has ("model" is optional).
TRAINER_KEYS = ("optimizer", "scaler", "scheduler", "counters", "history", "node_overflows",
                "healed", "plan", "rng")
_REQUIRED = ("optimizer", "scaler", "counters", "history")
_COUNTERS = ("micro_steps", "steps", "skipped_steps", "consecutive_overflows")
_HISTORY = ("scale", "grad_norm", "loss", "overflows")
_SCALER = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_SHOWN = 4  # mismatches listed in one message


def _refuse(problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"cannot resume from this checkpoint: {problem}; nothing was loaded "
                           f"(model, optimizer and scaler are unchanged)\n  what to do: {fix}")


def _listing(items: Sequence[str]) -> str:
    more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return "; ".join(items[:_SHOWN]) + more


def _shape(value: Any) -> str:
    return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"


def _check_kind(state: Any) -> None:
    """A trainer checkpoint at all: a mapping with the trainer's keys."""
    what = ("a trainer checkpoint is what Trainer.state_dict() returns, a dict with 'model' "
            "(the weights), " + ", ".join(repr(k) for k in TRAINER_KEYS))
    if not isinstance(state, Mapping):
        raise _refuse(f"it is a {type(state).__name__}, not a dict", what)
    missing = [k for k in _REQUIRED if k not in state]
    if not missing:
        return
    values = list(state.values())
    if values and all(isinstance(v, torch.Tensor) for v in values):
        first = next(iter(state))
        raise _refuse(f"it is a model's state_dict ({len(values)} tensors such as {first!r}), "
                      f"not a trainer checkpoint: it has no {', '.join(map(repr, missing))}",
                      f"{what}; to load only the weights call trainer.gm.load_state_dict(...) "
                      "(the optimizer and scaler then start afresh)")
    raise _refuse(f"it has no {', '.join(map(repr, missing))}", what)


def _check_model(saved: Any, model: nn.Module) -> None:
    if not isinstance(saved, Mapping):
        raise _refuse(f"its 'model' is a {type(saved).__name__}, not a state_dict",
                      "save with trainer.state_dict()")
    current = model.state_dict()
    problems: List[str] = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"missing {len(missing)} keys of this model: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} keys this model does not have: "
                        f"{_listing(unexpected)}")
    differ = []
    for key, value in current.items():
        other = saved.get(key)
        if not isinstance(value, torch.Tensor) or key not in saved:
            continue
        if not isinstance(other, torch.Tensor):
            differ.append(f"{key}: checkpoint {type(other).__name__}, model {_shape(value)}")
        elif other.shape != value.shape or other.dtype != value.dtype:
            differ.append(f"{key}: checkpoint {_shape(other)}, model {_shape(value)}")
    if differ:
        problems.append(f"{len(differ)} tensors differ in shape or dtype: {_listing(differ)}")
    if problems:
        raise _refuse(f"its model is not this model ({type(model).__name__}): "
                      + "; ".join(problems),
                      "resume with the model (same class, sizes and dtypes) the checkpoint was "
                      "saved from")


def _broadcasts(state_shape: torch.Size, param_shape: torch.Size) -> bool:
    """Whether a per-parameter state tensor fits its parameter: a scalar (``step``), or the
    parameter's shape with some dimensions 1 (Adafactor's factored rows and columns)."""
    if len(state_shape) == 0 or len(state_shape) != len(param_shape):
        return True  # a scalar, or a layout of the optimizer's own: nothing to compare
    return all(s in (p, 1) for s, p in zip(state_shape, param_shape))


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    current = optimizer.state_dict()
    if not (isinstance(current, Mapping) and "param_groups" in current):
        return  # an optimizer with a state_dict of its own format: torch's load checks it
    name = type(optimizer).__name__
    fix = ("resume with the optimizer the checkpoint was saved with (the same class and "
           "parameter groups over the same parameters, in the same order)")
    if not (isinstance(saved, Mapping) and isinstance(saved.get("param_groups"), list)
            and isinstance(saved.get("state"), Mapping)):
        raise _refuse("its 'optimizer' is not an optimizer's state_dict "
                      "(no 'state' and 'param_groups')", fix)
    groups, mine = saved["param_groups"], current["param_groups"]
    if len(groups) != len(mine):
        raise _refuse(f"its optimizer has {len(groups)} parameter groups, this {name} has "
                      f"{len(mine)}", fix)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index: Dict[Any, Any] = {}  # saved id -> (this optimizer's id, its parameter)
    for i, (group, own) in enumerate(zip(groups, mine)):
        ids = group.get("params", []) if isinstance(group, Mapping) else []
        if len(ids) != len(own["params"]):
            raise _refuse(f"its optimizer's parameter group {i} has {len(ids)} parameters, "
                          f"this {name}'s has {len(own['params'])}", fix)
        extra = sorted(set(group) - set(own))
        lacking = sorted(set(own) - set(group))
        if extra and lacking:  # keys only added by a newer torch are filled in by torch
            raise _refuse(f"its optimizer is another kind: parameter group {i} has "
                          f"{extra} where this {name} has {lacking}", fix)
        for saved_id, own_id in zip(ids, own["params"]):
            param = params[own_id] if isinstance(own_id, int) and own_id < len(params) else None
            index[saved_id] = (own_id, param)
    problems: List[str] = []
    for pid, entry in saved["state"].items():
        if pid not in index:
            problems.append(f"state for parameter {pid!r}, which no parameter group holds")
            continue
        own_id, param = index[pid]
        own = current["state"].get(own_id)
        if not isinstance(entry, Mapping) or param is None:
            continue
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if isinstance(own, Mapping) and isinstance(own.get(key), torch.Tensor):
                fits = own[key].shape == value.shape
            else:
                fits = _broadcasts(value.shape, param.shape)
            if not fits:
                problems.append(f"parameter {pid} {key!r} is {tuple(value.shape)}, the "
                                f"parameter is {tuple(param.shape)}")
        if isinstance(own, Mapping) and own and set(own) != set(entry):
            problems.append(f"parameter {pid} has state {sorted(entry)}, this {name} keeps "
                            f"{sorted(own)}")
    if problems:
        raise _refuse(f"its optimizer state does not fit this {name}'s parameters: "
                      f"{_listing(problems)}", fix)


def _check_scaler(saved: Any, scaler: torch.amp.GradScaler) -> None:
    if not isinstance(saved, Mapping):
        raise _refuse(f"its 'scaler' is a {type(saved).__name__}, not a GradScaler state_dict",
                      "save with trainer.state_dict()")
    if not scaler.is_enabled():
        return  # a disabled scaler loads nothing; a changed plan is warned about
    if not saved:
        raise _refuse("its GradScaler was disabled (a bfloat16 run, or enabled=False) and this "
                      "trainer's is enabled (float16): there is no loss scale to resume",
                      "resume with the dtype the checkpoint was trained in, or start the "
                      "scaler afresh: load the rest with the checkpoint's 'scaler' set to "
                      "trainer.scaler.state_dict()")
    missing = [k for k in _SCALER if k not in saved]
    if missing:
        raise _refuse(f"its 'scaler' has no {missing}", "save with trainer.state_dict()")


def _check_fields(state: Mapping) -> None:
    from .localize import Overflow  # the record the history holds

    counters, history = state["counters"], state["history"]
    fix = "save with trainer.state_dict()"
    if not isinstance(counters, Mapping) or any(
            not isinstance(counters.get(k), int) for k in _COUNTERS):
        raise _refuse(f"its 'counters' lack integer {', '.join(_COUNTERS)}", fix)
    if not isinstance(history, Mapping) or any(
            not isinstance(history.get(k), (list, tuple)) for k in _HISTORY):
        raise _refuse(f"its 'history' lacks the lists {', '.join(_HISTORY)}", fix)
    for record in history["overflows"]:
        try:
            Overflow(**record)
        except TypeError as err:
            raise _refuse(f"an overflow record in its history does not read back ({err})",
                          fix) from None
    for key in ("healed", "node_overflows"):
        if not isinstance(state.get(key) or {}, Mapping):
            raise _refuse(f"its {key!r} is a {type(state[key]).__name__}, not a dict", fix)
    rng = state.get("rng")
    if rng is not None:
        if not (isinstance(rng, Mapping) and isinstance(rng.get("torch"), torch.Tensor)
                and rng["torch"].dtype == torch.uint8
                and isinstance(rng.get("python"), (list, tuple)) and len(rng["python"]) == 3):
            raise _refuse("its 'rng' is not the RNG states trainer.state_dict() saves", fix)


def check_checkpoint(state: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler, scheduler: Any) -> None:
    """Raise :class:`CheckpointError` unless every part of ``state`` loads into this
    trainer's model, optimizer, scaler and scheduler; it changes nothing."""
    from ..plan import Plan  # the saved plan text must read back

    _check_kind(state)
    if "model" in state:
        _check_model(state["model"], model)
    _check_optimizer(state["optimizer"], optimizer)
    _check_scaler(state["scaler"], scaler)
    saved_sched = state.get("scheduler")
    if scheduler is not None and saved_sched is not None and not isinstance(saved_sched,
                                                                            Mapping):
        raise _refuse(f"its 'scheduler' is a {type(saved_sched).__name__}, not a state_dict",
                      "save with trainer.state_dict()")
    _check_fields(state)
    if state.get("plan"):
        try:
            Plan.from_text(state["plan"])
        except FxampError as err:
            raise _refuse(f"its plan text does not read back ({err})",
                          "save with trainer.state_dict()") from None


def _names(model: nn.Module) -> Dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def check_optimizer_params(model: nn.Module, groups: Iterable[Mapping[str, Any]]) -> None:
    """Refuse an optimizer that would not train ``model``: none of its parameters is one of
    the model's (an optimizer over another copy's parameters), or a parameter the model does
    not have stands where a trainable one of the model's, of the same shape, is missing (a
    copy's parameter mixed in). Extra parameters of the loss are fine."""
    names = _names(model)
    held = [p for g in groups for p in g["params"]]
    if not held:
        raise FxampError("the optimizer has no parameters; what to do: build it over the "
                         "rewritten model's parameters, e.g. torch.optim.AdamW(gm.parameters())")
    foreign = [p for p in held if id(p) not in names]
    if not foreign:
        return
    fix = ("build the optimizer over the parameters of the model that was rewritten: "
           "torch.optim.X(model.parameters()) with the model passed to fxamp.amp_rewrite "
           "(it shares its Parameters), or over gm.parameters(); a deepcopy or a reloaded "
           "model has Parameters of its own")
    if len(foreign) == len(held):
        raise FxampError(f"none of the optimizer's {len(held)} parameters is a parameter of "
                         f"the rewritten model {type(model).__name__}: its steps would change "
                         f"another copy of the weights and train nothing\n  what to do: {fix}")
    ids = {id(p) for p in held}
    untrained = [(n, p) for n, p in model.named_parameters()
                 if p.requires_grad and id(p) not in ids]
    twins = [(n, p) for n, p in untrained
             if any(f.shape == p.shape and f.dtype == p.dtype for f in foreign)]
    if twins:
        shown = _listing([f"{n} {tuple(p.shape)}" for n, p in twins])
        raise FxampError(f"{len(foreign)} of the optimizer's parameters are not the rewritten "
                         f"model's, and the model's trainable {shown} is in no parameter group "
                         f"though a foreign parameter of its shape is: the optimizer holds "
                         f"another copy's parameters\n  what to do: {fix}")
