"""``fxamp demo``: rewrite and train the built-in small CNN."""
from __future__ import annotations

import argparse
from typing import List

import torch

from ..policy import dtype_name
from .terminal import write_result


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    low = args.dtype
    result = run_demo(steps=args.steps, dtype=low, target=args.target)
    plan = result["plan"]
    write_result("demo", plan.to_text())
    losses: List[float] = result["losses"]  # type: ignore[assignment]
    print(f"\n{plan.count(low)} nodes in {dtype_name(low)}, {plan.count(torch.float32)} in fp32")
    print(f"trained {len(losses)} steps with GradScaler on {result['device']}: "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, final scale {result['scale']:.0f}")
    return 0
