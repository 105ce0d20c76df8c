"""Policy: the compute dtype, the target whose autocast lists are mirrored, and overrides.

A policy is a frozen dataclass with a string form (after deepmind/jmp)::

    Policy.parse("compute=bf16,target=cpu,fp32:encoder.layer.0.*,fp32:F.softmax")

Items are separated by commas. ``key=value`` sets a field; ``fp32:PATTERN``,
``fp16:PATTERN`` or ``bf16:PATTERN`` is an override: every node whose name, module path or op
label matches the glob PATTERN computes in that dtype (``rule="user"``). Later overrides win.
``off:RULE`` switches one numerics rule off (``NUMERICS_RULES``); ``numerics=off`` is
the shorthand for all of them plus ``output=keep`` (the autocast mirror). ``user:NAME`` names
a user's decision rule (``fxamp.DecisionRule``) the rewrite runs: the policy, and so a
plan's header, records its name; the rule object itself is given in the config
(``fxamp.RewriteConfig.make(rules=[...])``).

A recipe (``RECIPES``) is a name for a few items, read in their place: ``"cpu-bf16"`` is
``"compute=bf16,target=cpu"``, and ``"cpu-bf16,fp32:head.*"`` adds an override to it.
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field, replace
from typing import FrozenSet, Optional, Sequence, Tuple, Union

import torch

from .errors import PolicyError

_DTYPE_ALIASES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "f16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "full": torch.float32,
    "f32": torch.float32,
}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                torch.float64: "fp64"}
#: the names a compute (low) dtype is given by: fp32 is no compute dtype
COMPUTE_DTYPE_NAMES = tuple(sorted(k for k, v in _DTYPE_ALIASES.items() if v != torch.float32))
#: training targets mirror that device's torch.autocast; deployment targets are plans for an
#: inference engine: all low precision, FP32 only where numbers or the engine need it
TRAINING_TARGETS = ("cuda", "cpu")
DEPLOY_TARGETS = ("tensorrt",)
#: every target a policy takes
TARGETS = TRAINING_TARGETS + DEPLOY_TARGETS
#: the autocast device whose tables (follow / promote semantics) and runtime a target uses
_AUTOCAST_DEVICE = {"tensorrt": "cuda"}
_KEYS = ("compute", "target", "output", "numerics", "channels_last", "placement", "weights",
         "guard")
#: how weights reach low precision: see Policy.weights
WEIGHT_MODES = ("cast", "o2", "stored")
_ON, _OFF = ("on", "true", "1"), ("off", "false", "0")
#: named policies: each name is read as its items (a policy's text form never writes it)
RECIPES = {
    "cuda-fp16": "compute=fp16,target=cuda",
    "cuda-bf16": "compute=bf16,target=cuda",
    "cpu-bf16": "compute=bf16,target=cpu",
    "tensorrt": "compute=fp16,target=tensorrt",
}
#: the numerics rules ``off:RULE`` switches off one at a time (their plan rule names), in the
#: order the rewrite runs them; ``numerics=off`` switches off all of them
NUMERICS_RULES = ("softmax", "custom_ops", "norm_eps", "loss", "joins", "mask_fill")
#: how a user's decision rule is named: ``user:`` and a word of letters, digits, ``_``,
#: ``.`` and ``-`` (the plan's rule column and the policy item are this one name)
USER_RULE_PREFIX = "user:"
USER_RULE_NAME = re.compile(r"user:[A-Za-z_][A-Za-z0-9_.\-]*")


def is_user_rule(name: object) -> bool:
    """Whether ``name`` (a plan's rule column, a rule's ``name``) names a user's rule."""
    return isinstance(name, str) and name.startswith(USER_RULE_PREFIX)


def check_user_rule_name(name: object, what: str, error: type = PolicyError) -> str:
    """``name`` when it is a valid user rule name (:data:`USER_RULE_NAME`).

    Args:
        name: the name to check.
        what: whose name it is, for the message ("policy item", "rule KeepScales").
        error: the FxampError subclass raised.

    Returns:
        ``name``.

    Raises:
        PolicyError: (or ``error``) when it is no ``user:WORD``, saying how to spell it.
    """
    if isinstance(name, str) and USER_RULE_NAME.fullmatch(name):
        return name
    word = re.sub(r"[^A-Za-z0-9_.\-]+", "_", str(name).split(":")[-1]).strip("_") or "my_rule"
    if word[0].isdigit():
        word = "r" + word
    raise error(f"{what} {name!r} is not a user rule name: a user rule is named "
                      f"'user:WORD' (letters, digits, _ . -; the plan's rule column shows it "
                      f"and tells it from fxamp's own rules); what to do: name it "
                      f"'user:{word}'")


def _suggest(word: str, valid: Sequence[str]) -> str:
    """" (did you mean X?)" for the closest of ``valid`` to ``word``, else ""."""
    close = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_deploy(target: str) -> bool:
    """Whether ``target`` is a deployment plan (an inference engine), not a training one."""
    return target in DEPLOY_TARGETS


def autocast_device(target: str) -> str:
    """The torch.autocast device type of ``target``: itself for "cuda"/"cpu"; "cuda" for
    "tensorrt" (its opaque calls run under CUDA autocast; its follow/promote ops behave as
    there)."""
    return _AUTOCAST_DEVICE.get(target, target)


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """Short name of a dtype: fp16, bf16, fp32 (or the torch name)."""
    if dtype is None:
        return "-"
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def parse_dtype(text: Union[str, torch.dtype]) -> torch.dtype:
    """A dtype from an alias (``fp16``, ``half``, ``bf16``, ``fp32`` ...) or a torch.dtype."""
    if isinstance(text, torch.dtype):
        return text
    key = str(text).strip().lower().replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise PolicyError(f"unknown dtype {text!r}; valid: {', '.join(sorted(_DTYPE_ALIASES))}")
    return _DTYPE_ALIASES[key]


def _compute_error(got: str) -> str:
    return (f"compute dtype must be fp16 or bf16 (torch.float16 or torch.bfloat16; names: "
            f"{', '.join(COMPUTE_DTYPE_NAMES)}), got {got}; fxamp rewrites FP32 models into "
            "FP16/BF16 mixed precision. To keep nodes in FP32, use overrides such as "
            "fp32:head.* (fp32:* keeps the whole model in FP32)")


def parse_compute_dtype(text: Union[str, torch.dtype]) -> torch.dtype:
    """The low-precision compute dtype from an alias (``fp16``, ``half``, ``bf16``...) or a
    torch.dtype; PolicyError for anything else, ``fp32`` included, naming the valid names."""
    if isinstance(text, torch.dtype):
        dtype = text
    else:
        dtype = _DTYPE_ALIASES.get(str(text).strip().lower().replace("torch.", ""))
    if dtype is None:
        raise PolicyError(f"unknown dtype {text!r}: the " + _compute_error(repr(text)))
    if dtype not in (torch.float16, torch.bfloat16):
        raise PolicyError(_compute_error(repr(text) if isinstance(text, str) else str(text)))
    return dtype


@dataclass(frozen=True)
class Override:
    """Nodes matching ``pattern`` compute in ``dtype``; written ``fp32:head.*``.

    Args:
        dtype: the dtype the matching nodes compute in.
        pattern: a glob matched against a node's name, its module path or its op label.
    """

    dtype: torch.dtype
    pattern: str

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}:{self.pattern}"


@dataclass(frozen=True)
class Policy:
    """What to rewrite to. ``Policy.parse`` reads the text form
    (``"bf16,fp32:head.*,off:joins"``), which ``str(policy)`` writes.

    Args:
        compute: the low-precision dtype (float16 or bfloat16).
        target: whose autocast op lists are mirrored, "cuda" or "cpu" (training); or "tensorrt",
            a deployment plan: every floating op in the low dtype, FP32 only where a number
            forces it (a value range on the example inputs or calibration data, a deep
            reduction, a norm's eps, an op TensorRT has no FP16 kernel for), each with its
            reason (``passes/deploy.py``).
        overrides: per-node / per-module / per-op dtype overrides, later ones win.
        output_dtype: dtype of the floating outputs the plan made low precision (default FP32,
            like keep_io_types; an output the model converts itself keeps its dtype); None keeps
            what the graph computes.
        numerics: run the numerics passes (``NUMERICS_RULES``: softmax, custom ops, norm eps,
            loss, joins, and a deployment plan's attention-mask fills).
            ``Policy.parse("numerics=off")`` turns all of them off and, unless an ``output=`` item
            is given, also sets ``output_dtype=None`` (``output=keep``): with both,
            the rewrite mirrors autocast exactly, whose outputs keep the dtype their op gave.
            Setting the field directly changes only the rules.
        rules_off: numerics rules switched off one at a time (``off:joins``); nothing else
            changes (the output dtype neither). A rule runs when ``numerics`` is on and it is
            not in ``rules_off`` (``Policy.runs``).
        guard: (opt-in, off by default) a plan with ranges (calibration data, or any
            deployment plan) checks at run time each low-precision node whose range was
            measured: the first value past the limit the ranges rule kept it under (the low
            dtype's max / 2, / 128 for a deployment target) logs one warning naming the node and
            the value. Costs one reduction and one device sync per such node per call.
        channels_last: run 2-D convolutions in NHWC: the weights of the graph's 4-D convs are
            kept in channels_last memory format (in place: same Parameter objects, shared with
            the model) and the graph's 4-D floating inputs are made channels_last on entry.
        rules: the names of the user's decision rules the rewrite runs (``user:NAME`` items;
            ``fxamp.DecisionRule``), in the order they run. The rule objects are given
            with ``RewriteConfig.make(rules=[...])`` (``fxamp.RewriteConfig``); a policy
            naming a rule no object is given for is refused (``fxamp.RuleError``).
        placement: move free "follow" ops (view, relu, pooling, upsample ...) across the
            low/FP32 boundary where that casts fewer bytes per step (``passes/placement/``).
            Independent of ``numerics``; off, casts sit where autocast puts them.
        weights: how the FP32 weights reach low precision.
            "cast" (default): every forward casts each weight it computes with in the graph, as
            autocast does, and nothing is kept between steps. "o2" (apex O2 style,
            ``fxamp/weight_cache.py``): low-precision copies are kept between steps and
            ``fxamp.train.attach_optimizer(gm, optimizer)`` re-casts them right after each
            optimizer step, in one foreach operation, so forward and backward cast no weight;
            ``fxamp.weight_cache_bytes(gm)`` reports the memory.
            "stored" (inference and serving, ``rewriter/stored.py``; needs ``inplace=True``):
            each Parameter is stored at rest in the dtype of the nodes that compute with it: one
            read only by low-precision nodes is replaced in place by a low-precision Parameter
            (its FP32 values rounded once: autocast's numbers), one read by an FP32 island stays
            FP32, one read in both stays FP32 with one low-precision copy (the plan header's
            ``stored_copies`` names it); no stored weight is cast per call. Training is refused
            (``StoredWeightsError``): rewrite with "cast" to train.

    Raises:
        PolicyError: an unknown weights mode, target or numerics rule, a compute dtype
            other than float16 / bfloat16, or a user rule name that is no ``user:WORD``
            or is named twice.
    """

    compute: torch.dtype = torch.float16
    target: str = "cuda"
    overrides: Tuple[Override, ...] = field(default_factory=tuple)
    output_dtype: Optional[torch.dtype] = torch.float32
    numerics: bool = True
    rules_off: FrozenSet[str] = frozenset()
    channels_last: bool = False
    guard: bool = False
    placement: bool = True
    weights: str = "cast"
    rules: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self.rules:
            check_user_rule_name(name, "policy rule")
        if len(set(self.rules)) != len(self.rules):
            twice = next(n for n in self.rules if list(self.rules).count(n) > 1)
            raise PolicyError(f"user rule {twice!r} is named twice in the policy; what to do: "
                              "name each rule once")
        object.__setattr__(self, "rules", tuple(self.rules))
        if self.weights not in WEIGHT_MODES:
            raise PolicyError(f"weights takes {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        if self.compute not in (torch.float16, torch.bfloat16):
            raise PolicyError(_compute_error(dtype_name(self.compute)))
        if self.target not in TARGETS:
            raise PolicyError(f"unknown target {self.target!r}; valid targets: "
                              f"{', '.join(TARGETS)}")
        unknown = sorted(set(self.rules_off) - set(NUMERICS_RULES))
        if unknown:
            raise PolicyError(f"unknown numerics rule {unknown[0]!r}"
                              f"{_suggest(unknown[0], NUMERICS_RULES)}; rules off:RULE "
                              f"switches: {', '.join(NUMERICS_RULES)}")
        object.__setattr__(self, "rules_off", frozenset(self.rules_off))

    def runs(self, rule: str) -> bool:
        """Whether the numerics rule ``rule`` runs: ``numerics`` on and the rule not in
        ``rules_off``.

        Args:
            rule: one of ``NUMERICS_RULES``.

        Returns:
            True when the rule runs.
        """
        assert rule in NUMERICS_RULES, rule
        return self.numerics and rule not in self.rules_off

    @classmethod
    def parse(cls, text: str, base: Optional["Policy"] = None) -> "Policy":
        """Parse the string form (comma-separated items: ``compute=bf16``, ``target=cpu``,
        ``fp32:head.*``, ``off:joins``, ``numerics=off``, ``weights=o2``, a recipe name
        such as ``cpu-bf16`` (``RECIPES``)...).

        Args:
            text: the policy's text form, as ``str(policy)`` writes it.
            base: the policy whose fields the text does not set are kept (default:
                ``Policy()``); its overrides come first.

        Returns:
            The policy.

        Raises:
            PolicyError: an unknown key, dtype, rule or value, or an override without a
                pattern; the message names the item.
        """
        policy = base or cls()
        overrides = list(policy.overrides)
        output_given = False
        for item in (part.strip() for part in _expand_recipes(text).split(",")):
            if not item:
                continue
            if "=" in item:
                key, _, value = item.partition("=")
                key, value = key.strip().lower(), value.strip()
                if key not in _KEYS:
                    raise PolicyError(f"unknown policy key {key!r}{_suggest(key, _KEYS)} in "
                                      f"{text!r}; valid keys: {', '.join(_KEYS)}, or "
                                      "DTYPE:PATTERN overrides, or off:RULE (rules: "
                                      f"{', '.join(NUMERICS_RULES)}), or user:NAME")
                if key == "compute":
                    policy = replace(policy, compute=parse_compute_dtype(value))
                elif key == "target":
                    policy = replace(policy, target=value.lower())
                elif key == "output":
                    output_given = True
                    policy = replace(policy, output_dtype=None if value in ("keep", "-")
                                     else parse_dtype(value))
                elif key == "guard":
                    if value.lower() not in _ON + _OFF:
                        raise PolicyError(f"guard takes on or off, got {value!r}")
                    policy = replace(policy, guard=value.lower() in _ON)
                elif key == "channels_last":
                    if value.lower() not in _ON + _OFF:
                        raise PolicyError(f"channels_last takes on or off, got {value!r}")
                    policy = replace(policy, channels_last=value.lower() in _ON)
                elif key == "placement":
                    if value.lower() not in _ON + _OFF:
                        raise PolicyError(f"placement takes on or off, got {value!r}")
                    policy = replace(policy, placement=value.lower() in _ON)
                elif key == "weights":
                    if value.lower() not in WEIGHT_MODES:
                        raise PolicyError(f"weights takes {', '.join(WEIGHT_MODES)} (cast "
                                          f"every forward; keep copies re-cast in the "
                                          f"optimizer step; or, for inference, store each "
                                          f"weight in its nodes' dtype), got {value!r}")
                    policy = replace(policy, weights=value.lower())
                else:
                    if value.lower() not in ("on", "off", "true", "false", "1", "0"):
                        raise PolicyError(f"numerics takes on or off, got {value!r}")
                    on = value.lower() in ("on", "true", "1")
                    # numerics=on turns every rule back on; numerics=off is the autocast
                    # mirror: every rule off and (unless output= says) outputs kept
                    policy = replace(policy, numerics=on, rules_off=frozenset())
                    if not on and not output_given:
                        policy = replace(policy, output_dtype=None)
            elif is_user_rule(item):
                name = check_user_rule_name(item, "policy item")
                if name not in policy.rules:
                    policy = replace(policy, rules=policy.rules + (name,))
            elif item.partition(":")[0].strip().lower() == "off":
                rule = item.partition(":")[2].strip().lower()
                if rule not in NUMERICS_RULES:
                    raise PolicyError(f"unknown numerics rule {rule!r}"
                                      f"{_suggest(rule, NUMERICS_RULES)} in {item!r}; "
                                      f"off:RULE takes {', '.join(NUMERICS_RULES)} "
                                      "(numerics=off switches off all of them)")
                if policy.numerics:  # (after numerics=off every rule is off already)
                    policy = replace(policy, rules_off=policy.rules_off | {rule})
            elif ":" in item:
                dtype, _, pattern = item.partition(":")
                if not pattern.strip():
                    raise PolicyError(f"override {item!r} has no pattern; write e.g. fp32:head.*")
                overrides.append(Override(parse_dtype(dtype), pattern.strip()))
            else:
                raise PolicyError(f"cannot read policy item {item!r}{_suggest(item, RECIPES)} "
                                  f"in {text!r}; write key=value (keys: {', '.join(_KEYS)}), "
                                  f"DTYPE:PATTERN or a recipe ({', '.join(RECIPES)})")
        return replace(policy, overrides=tuple(overrides))

    def __str__(self) -> str:
        parts = [f"compute={dtype_name(self.compute)}", f"target={self.target}"]
        if not self.numerics:
            parts.append("numerics=off")
        else:
            parts.extend(f"off:{rule}" for rule in NUMERICS_RULES if rule in self.rules_off)
        if self.channels_last:
            parts.append("channels_last=on")
        if self.guard:
            parts.append("guard=on")
        if not self.placement:
            parts.append("placement=off")
        if self.weights != "cast":
            parts.append(f"weights={self.weights}")
        if self.output_dtype != (torch.float32 if self.numerics else None):
            parts.append(f"output={dtype_name(self.output_dtype) if self.output_dtype else 'keep'}")
        parts.extend(self.rules)
        parts.extend(str(o) for o in self.overrides)
        return ",".join(parts)

    def overrides_matching(self, *names: str) -> Tuple[Override, ...]:
        """Every override whose pattern matches any of ``names``, in order: the last one
        wins.

        Args:
            *names: a node's name, module path and op label (empty ones are skipped).

        Returns:
            The matching overrides.
        """
        return tuple(o for o in self.overrides
                     if any(name and fnmatch.fnmatchcase(name, o.pattern) for name in names))

    def override_for(self, *names: str) -> Optional[Override]:
        """The last override whose pattern matches any of ``names``.

        Args:
            *names: a node's name, module path and op label (empty ones are skipped).

        Returns:
            The override that wins, or None.
        """
        found = self.overrides_matching(*names)
        return found[-1] if found else None


def _expand_recipes(text: str) -> str:
    """``text`` with each item that is a recipe name replaced by the recipe's items."""
    return ",".join(RECIPES.get(item.strip().lower(), item) for item in text.split(","))


def names_target(policy: Union[None, str, Policy]) -> bool:
    """Whether ``policy`` fixes the target itself: a :class:`Policy` (it holds one), or a
    string with a ``target=`` item or a recipe (which wins over ``RewriteConfig.make``'s
    ``target=``).

    Args:
        policy: what ``RewriteConfig.make`` was given as ``policy=``.

    Returns:
        True when the policy's own target is the one the plan is for.
    """
    if isinstance(policy, Policy):
        return True
    if not isinstance(policy, str):
        return False
    return any(item.partition("=")[0].strip().lower() == "target"
               for item in _expand_recipes(policy).split(",") if "=" in item)


def make_policy(policy: Union[None, str, Policy], dtype: torch.dtype, target: str) -> Policy:
    """The policy amp_rewrite uses: ``policy`` if a Policy, else parsed over dtype/target."""
    if isinstance(policy, Policy):
        return policy
    dtype = parse_compute_dtype(dtype)
    base = Policy(compute=dtype, target=target)
    if policy is None:
        return base
    if isinstance(policy, str):
        return Policy.parse(policy, base)
    raise PolicyError(f"policy must be a fxamp.Policy or a string, got {type(policy).__name__}")
