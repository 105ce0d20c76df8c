"""RewriteConfig: everything a rewrite was asked for, made once and kept with the result.

``amp_rewrite`` takes one ``RewriteConfig`` (``RewriteConfig.make``: policy, dtype and
target folded into the ``Policy``, the front end, the example keyword
arguments, the calibration) and stores it on the rewritten module; whoever rewrites the same
model again reads it there (``fxamp.result.config_of``) instead of re-parsing the plan header:
the trainer's healing, the tolerance search, the audit and the CLI. After a rewrite the
stored config's ``calibration`` is the collected value ranges (so rewriting again needs no
data and gives the same range decisions).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
import torch.nn as nn

from .errors import CalibrationDataError, FxampError, PolicyError, RuleError
from .plan import Plan, RangeStats
from .policy import Policy, dtype_name, make_policy, names_target, parse_compute_dtype
from .rules import DecisionRule, checked_rules
from .runtime import first_device

#: the front ends (``frontends.REGISTRY`` names) each ``frontend=`` value tries, in order:
#: "auto" tries fx, then export, then fx with runtime leaves (partial tracing), then eager
#: (the model's forward stays Python, its children are rewritten)
FRONTEND_ORDER: Dict[str, Tuple[str, ...]] = {
    "auto": ("fx", "export", "fx+runtime", "eager"),
    "fx": ("fx",),
    "export": ("export",),
}
#: front ends a rewrite can ask for
FRONTENDS = tuple(FRONTEND_ORDER)

Calibration = Union[None, Iterable[Any], Plan, Dict[str, RangeStats]]
#: what ``rules=`` takes: one user rule object, several, or None
Rules = Union[None, DecisionRule, Iterable[DecisionRule]]


#: the partitions ``RewriteConfig.partition`` names (besides a function)
PARTITIONS = ("auto", "blocks", "flat")


@dataclass(frozen=True)
class RewriteConfig:
    """How to rewrite: the policy, the front end, the example keyword arguments, the
    calibration and torch.export's ``dynamic_shapes``: ``amp_rewrite``'s ``config``.
    Build one with keywords, ``RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
    policy="fp32:head.*")`` (the constructor takes the resolved fields: a ``Policy``, not its
    text, and ``calibration`` for ``make``'s ``calibration_data``); change one with
    ``replace``; ``fxamp.config_of(gm)`` reads a rewrite's.

    Args:
        policy: the ``Policy`` (dtype, target, overrides, rules).
        frontend: ``"auto"``, ``"fx"`` or ``"export"``, as in ``amp_rewrite``.
        example_kwargs: the forward's keyword arguments for the trace (not compared).
        calibration: an iterable of input tuples, a ``Plan`` whose ranges to reuse, or
            ranges (not compared).
        dynamic_shapes: torch.export's ``dynamic_shapes`` (None: the export front end's
            default; not compared).
        rules: the user's decision rules (``fxamp.DecisionRule`` objects, run in order;
            the policy's ``rules`` holds their names, so the plan header names them). A
            policy naming a user rule (``user:NAME``, as a plan's header policy does) needs
            the rule object of that name here: a plan file holds rule names, not their
            code, so re-applying it without the object raises ``RuleError``.
        follow_device: no target was given (neither ``target=`` nor the policy's
            ``target=``), so the plan is for the device the model is on when it is planned
            (``model_target``); the policy's target is a placeholder until then. An in-place
            rewrite without example inputs keeps it until its first call; every other
            rewrite resolves it at once (``for_model``), and the config a rewrite stores
            never has it.
        partition: which modules an in-place rewrite plans as regions of their own, each a
            module that keeps its place in the model's tree (its hooks, FSDP2's
            ``fully_shard`` per layer, a per-layer ``compile()`` keep working), with the
            model's own forward around them (traced by torch.fx with the regions as calls,
            or under ``torch.autocast``): ``"auto"`` (the default: the blocks, repeated
            children or ``_no_split_modules``, and where the glue runs under autocast its
            modules with weights (none a block holds too) and any module an override names;
            with example inputs too, the example then the first call, planned now, unless
            calibration batches or ``dynamic_shapes`` need one graph of the whole model; a
            returned module is one graph), ``"blocks"`` (the blocks and the glue's modules,
            its embeddings, final norm and head, each with plan lines), ``"flat"`` (one
            graph of the whole model), or a function ``(path, module) -> bool`` picking the
            regions (the outermost modules it picks, as torchao's ``module_filter_fn``).
        regions: the submodules a trace keeps as module calls, each computing with its own
            rewrite (block mode's glue, the model's own forward around its regions, traced
            by torch.fx: ``rewriter/glue.py``); set by fxamp, not by users.
        elsewhere: overrides of the policy that another region of the model may match
            instead of this one (block mode gives an op label to every block and to the
            glue): one that matches no node here is not refused here, the model's composed
            plan checks it (``rewriter/blocks.py``); set by fxamp, not by users.

    Raises:
        FxampError: an unknown front end.
        CalibrationDataError: a ``calibration`` that is no collection of batches.
        RuleError: a rule that is no ``DecisionRule``, or one the policy names is missing.
    """

    policy: Policy
    frontend: str = "auto"
    example_kwargs: Optional[Dict[str, Any]] = field(default=None, compare=False)
    calibration: Calibration = field(default=None, compare=False)
    dynamic_shapes: Any = field(default=None, compare=False)
    rules: Tuple[DecisionRule, ...] = ()
    follow_device: bool = False
    partition: Any = "auto"
    regions: Tuple[str, ...] = ()
    elsewhere: Tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.frontend not in FRONTENDS:
            raise FxampError(f"unknown frontend {self.frontend!r}; valid: "
                             f"{', '.join(FRONTENDS)}")
        if self.partition not in PARTITIONS and not callable(self.partition):
            raise FxampError(f"unknown partition {self.partition!r}; valid: "
                             f"{', '.join(PARTITIONS)}, or a function (path, module) -> bool")
        check_calibration(self.calibration)
        rules = checked_rules(self.rules)
        names = tuple(str(rule.name) for rule in rules)
        missing = [name for name in self.policy.rules if name not in names]
        if missing:
            raise RuleError(
                f"the policy names the user rule{'s' if len(missing) > 1 else ''} "
                f"{', '.join(missing)}, but no rule object of that name was given (a plan "
                "file records a rule's name, not its code); what to do: pass the rule "
                f"objects too, RewriteConfig.make(..., rules=[...]) (on the command line --rule "
                "MODULE:OBJECT)")
        object.__setattr__(self, "rules", rules)
        if names != self.policy.rules:  # (the policy names the rules that run, in order)
            object.__setattr__(self, "policy", dataclasses.replace(self.policy, rules=names))

    @classmethod
    def make(cls, policy: Union[None, str, Policy] = None, dtype: Optional[torch.dtype] = None,
             target: Optional[str] = None, frontend: str = "auto",
             example_kwargs: Optional[Dict[str, Any]] = None,
             calibration_data: Calibration = None,
             dynamic_shapes: Any = None, rules: Rules = None,
             partition: Any = "auto") -> "RewriteConfig":
        """A config from keywords: ``RewriteConfig.make(dtype=torch.bfloat16,
        target="cpu")``, ``RewriteConfig.make(policy="cpu-bf16")`` (a recipe,
        ``fxamp.policy.RECIPES``); ``amp_rewrite(model, inputs, "cpu-bf16")`` is the same.

        Args:
            policy: a ``Policy`` or its text form (recipe names included).
            dtype: the low-precision dtype (default float16, or the policy's ``compute=``).
            target: ``"cuda"``, ``"cpu"`` or ``"tensorrt"``; None (and no ``target=`` in
                the policy): the config follows the model's device (``follow_device``;
                "cuda" until ``for_model`` resolves it).
            frontend: ``"auto"``, ``"fx"`` or ``"export"``.
            example_kwargs: the forward's keyword arguments for the trace.
            calibration_data: an iterable of input tuples, a ``Plan`` or ranges.
            dynamic_shapes: torch.export's ``dynamic_shapes``.
            rules: the user's decision rules (``fxamp.DecisionRule`` objects).
            partition: ``"auto"``, ``"blocks"``, ``"flat"`` or a function ``(path,
                module) -> bool`` (see the class docstring).

        Returns:
            The config.

        Raises:
            PolicyError: ``dtype`` and the policy's ``compute=`` disagree, or a bad policy.
            FxampError: an unknown front end.
            RuleError: a rule that is no DecisionRule, or one the policy names is missing.
        """
        follow = target is None and not names_target(policy)
        return cls(_policy(policy, dtype, target or "cuda"), frontend,
                   dict(example_kwargs) if example_kwargs else None, calibration_data,
                   dynamic_shapes, rules, follow, partition)  # (checked in __post_init__)

    def for_model(self, model: nn.Module, inputs: Any = None) -> "RewriteConfig":
        """This config with its target resolved: when it follows the device, the policy's
        target becomes ``model_target`` of ``model`` (and ``inputs``); else itself.

        Args:
            model: the model about to be planned.
            inputs: its example inputs (positional and keyword), for a model without
                Parameters or buffers.

        Returns:
            A config whose ``follow_device`` is False.
        """
        if not self.follow_device:
            return self
        target = model_target(model, inputs)
        return self.replace(policy=dataclasses.replace(self.policy, target=target),
                            follow_device=False)

    def replace(self, **changes: Any) -> "RewriteConfig":
        """A copy with ``changes`` (``dataclasses.replace``).

        Args:
            **changes: new values of fields (``frontend="fx"``, ``policy=...``).

        Returns:
            The changed copy.
        """
        return dataclasses.replace(self, **changes)

    def for_part(self) -> "RewriteConfig":
        """The config a part of the model (a block, a child rewritten on its own) is
        rewritten with: this one's policy, rules and device, its outputs kept in the dtype
        they have (the values flow on into the rest of the model), the front ends tried in
        the default order.

        Returns:
            The part's config.
        """
        return RewriteConfig(dataclasses.replace(self.policy, output_dtype=None), "auto",
                             rules=self.rules, follow_device=self.follow_device)

    def with_fp32(self, names: Iterable[str]) -> "RewriteConfig":
        """A copy whose policy adds an ``fp32:NAME`` override per name.

        Args:
            names: node names (or patterns) to keep in FP32.

        Returns:
            The changed copy (``self`` when ``names`` is empty).
        """
        names = list(names)
        if not names:
            return self
        return self.replace(policy=Policy.parse(",".join(f"fp32:{n}" for n in names),
                                                base=self.policy))


def model_target(model: nn.Module, inputs: Any = None) -> str:
    """The target a rewrite given none plans for: the device type of ``model``'s first
    floating Parameter or buffer, else of the first tensor in ``inputs``; "cpu" for a CPU
    device, "cuda" for every other (``meta``, the device the CLI plans on, included) and
    when neither has a tensor.

    Args:
        model: the model being rewritten.
        inputs: its example inputs (any nesting of tuples, lists and dicts), or None.

    Returns:
        "cpu" or "cuda".
    """
    return "cpu" if first_device(model, inputs) == "cpu" else "cuda"


#: what ``calibration_data`` takes, for the errors
CALIBRATION_FORMS = ("an iterable of batches, each a tuple of the model's positional inputs "
                     "like example_inputs (a list, a generator, a DataLoader), a Plan whose "
                     "@range lines to reuse, or None")


def check_calibration(data: Any) -> None:
    """Refuse a ``calibration_data`` that is no collection of batches (a number, a string,
    one tensor) with ``CalibrationDataError``; the batches themselves are checked when
    they are run."""
    if data is None or isinstance(data, (Plan, dict)):
        return
    if isinstance(data, torch.Tensor):
        raise CalibrationDataError(
            f"calibration_data is one tensor of shape {tuple(data.shape)}, which would be read "
            f"as one batch per row; it takes {CALIBRATION_FORMS}\n  what to do: pass a list "
            "of batches, e.g. calibration_data=[(x,)]")
    iterable = isinstance(data, Iterable) or hasattr(data, "__getitem__")
    if not iterable or isinstance(data, (str, bytes)):
        shown = repr(data)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise CalibrationDataError(
            f"calibration_data={shown} (type {type(data).__name__}) is not a collection of "
            f"batches; it takes {CALIBRATION_FORMS}\n  what to do: pass e.g. "
            "calibration_data=[(x1,), (x2,)], or leave it out")


def _policy(policy: Union[None, str, Policy], dtype: Optional[torch.dtype],
            target: str) -> Policy:
    """make_policy, refusing a ``dtype`` that the policy's compute dtype contradicts."""
    pol = make_policy(policy, torch.float16 if dtype is None else dtype, target)
    if dtype is not None:
        asked = parse_compute_dtype(dtype)
        if asked != pol.compute:
            raise PolicyError(
                f"dtype={asked} conflicts with the policy's compute={dtype_name(pol.compute)}"
                f" ({policy}); what to do: give the low dtype once, either dtype= or "
                "compute= in the policy")
    return pol
