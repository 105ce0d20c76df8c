"""``fxamp audit``: what works against mixed precision in a model, as findings."""
from __future__ import annotations

import argparse

from .factory import config_from_args, plan_only


def cmd_audit(args: argparse.Namespace) -> int:
    from ..passes.audit import summary
    from ..rewriter.audit import audit

    config = config_from_args(args)
    findings = plan_only(args, lambda model, inputs: audit(model, inputs, config=config,
                                                           onnx=args.onnx))
    order = ("error", "warning", "info")
    shown = [f for f in findings if order.index(f.severity) <= order.index(args.min_severity)]
    for finding in shown:
        print(finding)
    hidden = len(findings) - len(shown)
    print(summary(findings) + (f" ({hidden} below {args.min_severity} not shown)"
                               if hidden else ""))
    return 1 if any(f.severity == "error" for f in findings) else 0
