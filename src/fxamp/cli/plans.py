"""``fxamp plan``, ``fxamp diff`` and ``fxamp check``: a model's plan, printed, written,
compared with another plan file or with the committed one."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Optional, Set

from ..errors import FxampError
from ..fileio import atomic_write_text
from .factory import rewrite_from_args
from .terminal import write_result


def cmd_plan(args: argparse.Namespace) -> int:
    from .. import plan_of

    if args.output:
        gm = rewrite_from_args(args)
    else:  # stdout is the plan alone: what the model's code prints goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            gm = rewrite_from_args(args)
    text = plan_of(gm).to_text()
    if args.output:
        atomic_write_text(args.output, text)
        print(f"wrote {args.output} ({len(plan_of(gm).nodes)} nodes)")
    else:
        write_result("plan", text, " or give -o FILE")
    return 0


def _load_plan(command: str, path: str, hint: str = "", quiet: bool = False
               ) -> Optional[Any]:
    """Plan.load, or None after one line on stderr (unreadable, not UTF-8, truncated...;
    nothing printed when ``quiet``)."""
    from ..plan import Plan

    try:
        return Plan.load(path)
    except OSError as err:
        problem = f"cannot read {path}: {err.strerror or err}{hint}"
    except FxampError as err:
        problem = f"{path}: {err}"
    if not quiet:
        print(f"fxamp {command}: {problem}", file=sys.stderr)
    return None


def cmd_diff(args: argparse.Namespace) -> int:
    """``fxamp diff OLD NEW``: 0 and no output when the plans decide the same, 1 and the
    diff (a change alike in several blocks of a block-mode plan once, naming them) when
    they differ, 2 and one line on stderr for a file that is no complete plan, or is a
    skeleton (a block-mode model's plan before its first call: no decisions to compare).

    Args:
        args: the command's arguments (``old``, ``new``, ``format``).
    """
    from ..plan import diff, skeleton_refusal

    plans = []
    for path in (args.old, args.new):
        plan = _load_plan("diff", path)
        if plan is None:
            return 2
        if not plan.planned:
            print(f"fxamp diff: {skeleton_refusal(path)}", file=sys.stderr)
            return 2
        plans.append(plan)
    text = diff(*plans, fmt=args.format)
    write_result("diff", text)
    return 1 if text else 0


def _merged(own: Any, committed: Any) -> Any:
    """The model's own ranges with the committed ones added: per node the larger maximum,
    underflow and non-finite count (a node only one of them has is kept as it is)."""
    from ..plan import RangeStats

    merged = dict(own)
    for name, c in (committed or {}).items():
        o = merged.get(name)
        merged[name] = c if o is None else RangeStats(
            max(o.max_abs, c.max_abs), max(o.underflow, c.underflow),
            max(o.nonfinite, c.nonfinite))
    return merged


def _checked_plan(args: argparse.Namespace, committed: Any) -> Any:
    """The plan ``check`` compares: a deployment target's from the model's own example
    (its calibration batch), the committed ``@range`` lines only as extra calibration;
    any other target's with the committed ranges as its calibration (the CLI has no
    batches)."""
    from .. import plan_of
    from ..policy import is_deploy
    from .factory import config_from_args

    ranges = committed.ranges if committed is not None else None
    if not is_deploy(config_from_args(args).policy.target):
        return plan_of(rewrite_from_args(args, ranges))
    own = plan_of(rewrite_from_args(args))
    if not ranges:
        return own
    merged = _merged(own.ranges, ranges)
    if merged == dict(own.ranges):
        return own
    return plan_of(rewrite_from_args(args, merged))


def user_rules_of(plan: Any) -> Set[str]:
    """The user rules a plan names: in its header's policy and in its rule column."""
    from ..policy import is_user_rule

    named = {item.strip() for item in plan.policy.split(",") if is_user_rule(item.strip())}
    return named | {p.rule for p in plan.nodes.values() if is_user_rule(p.rule)}


def cmd_check(args: argparse.Namespace) -> int:
    from ..plan import diff

    if args.update:  # (ranges the file holds, from the Python API's calibration, are kept)
        kept = _load_plan("check", args.plan, quiet=True) if os.path.isfile(args.plan) else None
        plan = _checked_plan(args, kept)
        plan.save(args.plan)
        print(f"wrote {args.plan} ({len(plan.nodes)} nodes)")
        return 0
    # the model's own errors come first; a deployment plan is made from the model's own
    # example, the committed ranges only adding calibration
    committed = _load_plan("check", args.plan, quiet=True)
    plan = _checked_plan(args, committed)
    if committed is None:
        _load_plan("check", args.plan, "; create it with --update")
        return 2
    text = diff(committed, plan, fmt=args.format)
    if text:
        write_result("check", text)
        print(f"fxamp check: the plan of {args.factory} differs from {args.plan}; review the "
              "change, then run again with --update to accept it", file=sys.stderr)
        missing = sorted(user_rules_of(committed) - user_rules_of(plan))
        if missing:
            print(f"fxamp check: {args.plan} was made with the user rule"
                  f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}, which this run "
                  "did not have (a plan file names its rules, not their code); what to do: "
                  "give each with --rule MODULE:NAME", file=sys.stderr)
        return 1
    print(f"fxamp check: {args.factory} matches {args.plan} ({len(plan.nodes)} nodes)")
    return 0
