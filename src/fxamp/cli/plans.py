"""``fxamp plan``, ``fxamp diff`` and ``fxamp check``: a model's plan, printed, written,
compared with another plan file or with the committed one."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from ..errors import FxampError
from ..fileio import atomic_write_text
from .factory import _rewrite


def _cmd_plan(args: argparse.Namespace) -> int:
    from .. import plan_of

    gm = _rewrite(args)
    text = plan_of(gm).to_text()
    if args.output:
        atomic_write_text(args.output, text)
        print(f"wrote {args.output} ({len(plan_of(gm).nodes)} nodes)")
    else:
        sys.stdout.write(text)
    return 0


def _load_plan(command: str, path: str, hint: str = "") -> Optional[Any]:
    """Plan.load, or None after one line on stderr (unreadable, not UTF-8, truncated...)."""
    from ..plan import Plan

    try:
        return Plan.load(path)
    except OSError as err:
        print(f"fxamp {command}: cannot read {path}: {err.strerror or err}{hint}",
              file=sys.stderr)
    except FxampError as err:
        print(f"fxamp {command}: {path}: {err}", file=sys.stderr)
    return None


def _cmd_diff(args: argparse.Namespace) -> int:
    from ..plan import diff

    plans = []
    for path in (args.old, args.new):
        plan = _load_plan("diff", path)
        if plan is None:
            return 2
        plans.append(plan)
    text = diff(*plans, fmt=args.format)
    sys.stdout.write(text)
    return 1 if text else 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .. import plan_of
    from ..plan import diff

    plan = plan_of(_rewrite(args))
    if args.update:
        plan.save(args.plan)
        print(f"wrote {args.plan} ({len(plan.nodes)} nodes)")
        return 0
    committed = _load_plan("check", args.plan, "; create it with --update")
    if committed is None:
        return 2
    text = diff(committed, plan, fmt=args.format)
    if text:
        sys.stdout.write(text)
        print(f"fxamp check: the plan of {args.factory} differs from {args.plan}; review the "
              "change, then run again with --update to accept it", file=sys.stderr)
        return 1
    print(f"fxamp check: {args.factory} matches {args.plan} ({len(plan.nodes)} nodes)")
    return 0
