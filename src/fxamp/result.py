"""What a rewrite leaves on the module it returns: one frozen ``Rewritten`` under one
attribute (``RESULT``), read by ``plan_of`` / ``config_of`` / ``result_of``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional

from .config import RewriteConfig
from .errors import FxampError, NotPlannedError
from .plan import Plan
from .policy import Policy
from .program import RESULT, EntryCheck  # (RESULT: the attribute a result is kept under)
from .structure import Structure


@dataclass(frozen=True)
class Rewritten:
    """A rewrite's result: the plan it used, its policy, the label of the model it was made
    from (``nn.Linear``, ``MyNet``), for the top-level rewrite its config, and the
    ``Structure`` and the call structure its program checks on each call. Built once, at
    the end of the rewrite; a later change of plan (healing, the tolerance search) or of the
    model it reads (a shadow's rewrite moved onto the real model) stores a new one."""

    plan: Plan
    policy: Policy
    source: str = ""
    config: Optional[RewriteConfig] = None
    #: what the graphs read of the model, checked on each call (``fxamp.structure``)
    structure: Optional[Structure] = field(default=None, compare=False, repr=False)
    #: the example's call structure, checked on each call (``fxamp.frontends.calls``)
    calls: Optional[EntryCheck] = field(default=None, compare=False, repr=False)
    #: the training mode the graph was traced for: None when it follows the mode (both
    #: modes trace alike, or their difference became reads of ``training``), True / False
    #: when only that mode's graph could be kept; a call in the other mode never runs it
    mode: Optional[bool] = field(default=None, compare=False)
    #: a returned module's graphs for the mode ``mode`` is not (``rewriter/modes.py``),
    #: planned on its first call in that mode; None: such a call is refused (``ModeError``)
    other_mode: Optional[Callable[[Any, tuple, Dict[str, Any]], Any]] = field(
        default=None, compare=False, repr=False)

    def replace(self, **changes: Any) -> "Rewritten":
        """A copy with ``changes`` (the result itself is never changed)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Pending:
    """What an in-place rewrite without example inputs leaves on the model until its first
    call plans it: the config the plan will be made with."""

    config: RewriteConfig
    source: str = ""
    #: the model is being planned now, on a call in another thread
    planning: bool = False
    #: in block mode, what makes the model's skeleton (its blocks and policy, header
    #: ``planned: no``, see ``BlocksRoot.skeleton``): ``plan_of`` returns it until the
    #: first call; None for a model planned whole on its first call (``NotPlannedError``)
    skeleton: Optional[Callable[[], Plan]] = field(default=None, compare=False, repr=False)


def has_result(module: object) -> bool:
    """Whether ``module`` holds a rewrite's result."""
    return isinstance(getattr(module, RESULT, None), Rewritten)


def result_of(module: object) -> Rewritten:
    """The ``Rewritten`` ``module`` holds; FxampError when amp_rewrite did not make it."""
    value = getattr(module, RESULT, None)
    if isinstance(value, Pending) and value.planning:
        raise NotPlannedError(
            f"{value.source or type(module).__name__} is being planned now, on a call in "
            "another thread (rewritten in place, planned on its calls). what to do: read "
            "its plan once that call returns")
    if isinstance(value, Pending):
        skeleton = (" (fxamp.plan_of gives its skeleton meanwhile: its blocks and policy, no "
                    "decisions)" if value.skeleton is not None else "")
        raise NotPlannedError(
            f"{value.source or type(module).__name__} was rewritten in place without example "
            "inputs: it is planned on its first call, and nothing has run yet"
            f"{skeleton}. what to do: call the model once (a forward on a real batch), then "
            "read its plan; or pass example_inputs to amp_rewrite to plan it ahead of time")
    if not isinstance(value, Rewritten):
        raise FxampError(f"{type(module).__name__} was not made by fxamp.amp_rewrite; what "
                         "to do: call fxamp.amp_rewrite(model, example_inputs) first")
    return value


def one_mode(modules: Iterable[object]) -> Optional[bool]:
    """The training mode that rewritten ``modules`` hold a graph for only (``Rewritten.mode``;
    a model assembled from them or calling them is that mode's only too); None when every
    one follows the mode.

    Args:
        modules: rewritten modules (others are passed over).

    Returns:
        True (train) or False (eval), or None.
    """
    for module in modules:
        mode = result_of(module).mode if has_result(module) else None
        if mode is not None:
            return mode
    return None


def set_result(module: object, result: Rewritten) -> None:
    """Store ``result`` on ``module`` (a plain attribute, not a submodule or buffer)."""
    setattr(module, RESULT, result)


def plan_of(module: object) -> Plan:
    """The Plan that amp_rewrite used to make ``module``.

    A model rewritten in place in block mode (without example inputs, with repeated blocks)
    and not called yet gives its *skeleton*: the header (versions, policy, ``frontend:
    blocks``, ``planned: no``) and one line per block, each "not planned yet: planned on
    its first call"; ``Plan.planned`` is False, and what needs a real plan (``fxamp.diff``,
    ``fxamp check``, ``result_of``) refuses it with ``NotPlannedError``. After the first
    call it is the real plan.

    Args:
        module: a module ``amp_rewrite`` returned (or rewrote in place).

    Returns:
        Its ``Plan``: one ``NodePrecision`` per source node, in graph order (a block-mode
        model not called yet: its skeleton).

    Raises:
        NotPlannedError: ``module`` was rewritten in place without example inputs, not in
            block mode, and has not been called yet (or is being planned now).
        FxampError: ``amp_rewrite`` did not make ``module``.
    """
    value = getattr(module, RESULT, None)
    if isinstance(value, Pending) and value.skeleton is not None and not value.planning:
        return value.skeleton()
    return result_of(module).plan


def config_of(module: object) -> RewriteConfig:
    """The RewriteConfig ``module`` was made with by ``amp_rewrite``.

    Args:
        module: a module ``amp_rewrite`` returned (or rewrote in place, planned or not).

    Returns:
        The ``RewriteConfig``; ``amp_rewrite(model, inputs, config=config_of(gm))`` makes
        the same rewrite again.

    Raises:
        FxampError: ``amp_rewrite`` did not make ``module``, or it is a nested part of a
            rewrite (read the config of the module ``amp_rewrite`` returned).
    """
    pending = getattr(module, RESULT, None)
    if isinstance(pending, Pending):
        return pending.config
    config = result_of(module).config
    if config is None:
        raise FxampError(f"{type(module).__name__} is a nested part of a rewrite; what to do: "
                         "read the config of the module amp_rewrite returned")
    return config
