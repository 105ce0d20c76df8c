"""Norm eps pass (rule "norm_eps")."""
from __future__ import annotations

import torch.fx as fx

from ..policy import Policy
from . import PassResult


def norm_eps(gm: fx.GraphModule, policy: Policy) -> PassResult:
    return PassResult(gm, modified=False)
