"""apex "O2"-style weights: the optimizer step writes the low-precision weight copies.

With the policy ``weights=o2`` the rewritten GraphModule keeps a low-precision copy of each
FP32 weight (``fxamp/weight_cache.py``); ``attach_optimizer`` registers an optimizer
step post-hook that re-casts the copies of the weights the optimizer owns (and of any other
weight whose version counter or storage changed), in one ``torch._foreach_copy_`` per dtype
and device, right after the FP32 master weights are updated. Forward and backward then
cast no weight; the gradients still flow to the FP32 masters (the backward of
``Tensor.to``), so GradScaler's ``unscale_``, inf checks and skipped steps work on the
masters exactly as without fxamp. A step GradScaler skips never calls
``optimizer.step()``: the masters and the copies stay as they were.
``fxamp.train.Trainer`` attaches itself when the policy says ``weights=o2``.

::

    gm = fxamp.amp_rewrite(model, (x,), "cpu-bf16,weights=o2")
    opt = torch.optim.AdamW(model.parameters())
    fxamp.train.attach_optimizer(gm, opt)
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Union

import torch
import torch.nn as nn

from ..errors import FxampError
from ..weight_cache import caches

log = logging.getLogger(__name__)


def refresh_weights(gm: nn.Module) -> int:
    """Re-cast every low-precision weight copy ``gm`` keeps, after a write fxamp cannot see
    (an in-place change through ``.data`` between forwards without grad and without an
    optimizer step, a state-dict load).

    Args:
        gm: a module rewritten with the policy ``weights=o2``, or a model rewritten in
            place.

    Returns:
        The number of weights cast, or marked for the next forward to cast where their
        memory is freed (FSDP2 between all-gathers); 0 when ``gm`` keeps no copies.
    """
    return sum(cache.refresh(only_stale=False) for cache in caches(gm))


def attach_optimizer(gm: Union[nn.Module, Callable[[], nn.Module]],
                     optimizer: torch.optim.Optimizer) -> Any:
    """Re-cast ``gm``'s weight copies after every ``optimizer.step()``.

    Args:
        gm: a module rewritten with the policy ``weights=o2``, or a function returning it
            (the Trainer passes one, since healing replaces its GraphModule).
        optimizer: the optimizer whose steps write the weights.

    Returns:
        The hook's handle (``.remove()`` detaches).

    Raises:
        FxampError: ``gm`` keeps no low-precision weight copies (rewrite with the policy
            ``weights=o2``).
    """
    get = gm if callable(gm) and not isinstance(gm, nn.Module) else (lambda: gm)
    found = caches(get())
    if not found:
        raise FxampError("attach_optimizer: this module keeps no low-precision weight copies "
                         "(it was rewritten with the default weights=cast, or casts no "
                         "weight); what to do: rewrite with policy weights=o2")
    for cache in found:
        cache.attached = True

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # the weights this step wrote: a fused step bumps no version counter, so their
        # copies look fresh to the cache and are re-cast by name
        owned = {id(p) for group in opt.param_groups for p in group["params"]}
        for cache in caches(get()):
            cache.attached = True
            # only copies a forward used since the last step: a compiled forward (the cache
            # steps aside while torch.compile traces) casts the weights in its own graph
            if cache.served:
                cache.served = False
                cache.refresh(owned=owned)
    return optimizer.register_step_post_hook(hook)
