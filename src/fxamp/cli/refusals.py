"""What the ``fxamp`` command refuses rather than ignores: a flag given twice (argparse
would keep the last value), a flag the ``--policy`` contradicts (``--target cuda --policy
cpu-bf16``: the policy's item would win), a flag the command does not use with the others
given (``export --backend`` without ``--report``, ``check --update --format``), and more
``--input-shape`` than the model's forward takes. Each is a :class:`~fxamp.errors.FxampError`
of one line naming the flag, the values and what to do, raised before any work."""
from __future__ import annotations

import argparse
import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import FactoryError, FxampError, PolicyError, shorten
from ..policy import RECIPES, dtype_name, parse_compute_dtype

__all__ = ["Once", "refuse_ignored_flags", "check_input_count"]

#: the Namespace attribute where :class:`Once` records the options given: dest -> values
GIVEN = "given_options"


class Once(argparse.Action):
    """``store`` that records each time the option is given (its spelling and value), so
    that a second one is refused (:func:`refuse_ignored_flags`) rather than replacing the
    first, and so that a flag given explicitly is told from its default."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        given: Dict[str, List[Tuple[str, Any]]] = getattr(namespace, GIVEN, None) or {}
        given.setdefault(self.dest, []).append((option_string or self.dest, values))
        setattr(namespace, GIVEN, given)
        setattr(namespace, self.dest, values)


def _given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the option of ``dest`` was on the command line (not its default)."""
    return dest in (getattr(args, GIVEN, None) or {})


def _shown(value: Any) -> str:
    """An option's value as it was written: a dtype by its name, a shape comma-separated."""
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return shorten(str(value))


_ONCE_HINT = {"policy": " (several policy items go comma-separated into one --policy, e.g. "
                        "--policy cpu-bf16,fp32:head.*)"}


def _refuse_repeats(args: argparse.Namespace) -> None:
    """FxampError when an option that takes one value was given more than once."""
    for dest, uses in (getattr(args, GIVEN, None) or {}).items():
        if len(uses) > 1:
            flags = list(dict.fromkeys(flag for flag, _ in uses))  # (as given, in order)
            values = ", ".join(_shown(v) for _, v in uses)
            times = "twice" if len(uses) == 2 else f"{len(uses)} times"
            raise FxampError(f"{'/'.join(flags)} given {times} ({values}); it takes one "
                             "value, and all but the last would be ignored; what to do: give "
                             f"it once{_ONCE_HINT.get(dest, '')}")


def _policy_items(policy: str) -> List[Tuple[str, str, Optional[str]]]:
    """The ``key=value`` items of a policy string, recipes expanded, in order: (key, value,
    the recipe the item comes from or None)."""
    items = []
    for item in (part.strip() for part in policy.split(",")):
        recipe = item.lower() if item.lower() in RECIPES else None
        for inner in (RECIPES[recipe].split(",") if recipe else [item]):
            key, eq, value = inner.partition("=")
            if eq:
                items.append((key.strip().lower(), value.strip(), recipe))
    return items


def _without(policy: str, key: str) -> str:
    """``policy`` with its ``key=`` items left out (a recipe replaced by its other items)."""
    kept = []
    for item in (part.strip() for part in policy.split(",")):
        inner = RECIPES[item.lower()].split(",") if item.lower() in RECIPES else [item]
        kept += [i for i in inner if i.partition("=")[0].strip().lower() != key]
    return ",".join(i for i in kept if i)


def _refuse_policy_conflicts(args: argparse.Namespace) -> None:
    """PolicyError when --dtype or --target says one thing and an item of --policy (its own
    or a recipe's) another: the policy's would win without a word."""
    policy = getattr(args, "policy", None)
    if not policy:
        return
    items = _policy_items(policy)
    flags = [("dtype", "--dtype", "compute", getattr(args, "dtype", None)),
             ("target", "--target", "target", getattr(args, "target", None))]
    for dest, flag, key, value in flags:
        named = [(v, recipe) for k, v, recipe in items if k == key]
        if not named or value is None or not _given(args, dest):
            continue
        theirs, recipe = named[-1]  # (the last item of a policy wins)
        try:
            same = (parse_compute_dtype(theirs) == value if key == "compute"
                    else theirs.lower() == value)
        except FxampError:
            continue  # a bad value: the policy's own error says so
        if same:
            continue
        ours = _shown(value)
        source = (f"--policy {shorten(policy)}, whose recipe {recipe} is {RECIPES[recipe]}"
                  if recipe else f"--policy {shorten(policy)}")
        rest = _without(policy, key)
        instead = (f"--policy {rest} {flag} {ours}" if rest
                   else f"{flag} {ours} without --policy")
        raise PolicyError(f"{flag} {ours} conflicts with the policy's {key}={theirs.lower()} "
                          f"({source}); what to do: give the {key} once: leave out {flag} to use "
                          f"{key}={theirs.lower()}, or for {ours} write {instead}")


#: flags a command uses only together with others: (command, dest, flag, needs, what for)
_NEEDS = (
    ("export", "backend", "--backend", ("report", "model_explorer"),
     "the backend runs the exported model only for --report and --model-explorer"),
    ("check", "format", "--format", ("!update",),
     "with --update the plan file is rewritten and nothing is compared or printed"),
)


def _refuse_unused(args: argparse.Namespace) -> None:
    """FxampError for a flag that the command would ignore with the other flags given."""
    for command, dest, flag, needs, why in _NEEDS:
        if args.command != command or not _given(args, dest):
            continue
        if needs == ("!update",):
            unused = bool(getattr(args, "update", False))
        else:
            unused = not any(getattr(args, n, None) for n in needs)
        if unused:
            what = ("leave out --format, or leave out --update to compare and print the "
                    "differences in that format" if needs == ("!update",)
                    else f"add {' or '.join('--' + n.replace('_', '-') for n in needs)} "
                    f"FILE, or leave out {flag}")
            raise FxampError(f"{flag} {_shown(getattr(args, dest))} would be ignored: {why}; "
                             f"what to do: {what}")


def refuse_ignored_flags(args: argparse.Namespace) -> None:
    """Refuse, before any work, the flags the command would ignore or override without a
    word (see the module).

    Args:
        args: the parsed command line.

    Raises:
        FxampError: a flag given twice, or one unused with the others given.
        PolicyError: --dtype or --target contradicting an item of --policy.
    """
    _refuse_repeats(args)
    _refuse_policy_conflicts(args)
    _refuse_unused(args)


def _inputs_text(low: int, high: int) -> str:
    count = f"{low}" if low == high else f"{low} to {high}"
    return f"{count} input{'' if high == 1 else 's'}"


def check_input_count(spec: str, model: torch.nn.Module,
                      shapes: Sequence[Tuple[int, ...]]) -> None:
    """Refuse more ``--input-shape`` than ``model``'s forward takes positionally: the
    tracers bind the inputs to the forward's parameters and would drop the rest. A forward
    with ``*args`` takes any number; one whose signature cannot be read is not checked.

    Args:
        spec: the MODULE:FACTORY the model comes from, for the message.
        model: the factory's model.
        shapes: the --input-shape values.

    Raises:
        FactoryError: more shapes than the forward's positional parameters.
    """
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(shapes) <= len(positional):
        return
    required = sum(p.default is p.empty for p in positional)
    names = ", ".join(p.name if p.default is p.empty else f"{p.name}=" for p in positional)
    given = " ".join(_shown(s) for s in shapes)
    extra = len(shapes) - len(positional)
    extra = "one" if extra == 1 else f"{extra}"
    raise FactoryError(
        f"{len(shapes)} --input-shape given ({given}), but the forward of {spec} "
        f"({type(model).__name__}) takes {_inputs_text(required, len(positional))}"
        f"{f' ({names})' if names else ''}, so the last {extra} would be ignored; what to "
        f"do: give one --input-shape per input of forward, in its order (at most "
        f"{len(positional)})")
