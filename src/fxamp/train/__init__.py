"""fxamp.train: a small, explicit training step around ``torch.amp.GradScaler``.

::

    gm = fxamp.amp_rewrite(model, (x,), "cuda-fp16")
    opt = torch.optim.AdamW(model.parameters())        # gm shares model's FP32 Parameters
    trainer = fxamp.train.Trainer(gm, opt, clip_grad_norm=1.0, scheduler=sched)
    for x, y in loader:
        r = trainer.step(lambda m, x, y: F.cross_entropy(m(x), y), x, y)
        if r.skipped:
            log.warning("%s", r.overflow)   # node, module path and source line

One ``Trainer.step`` is one micro-batch: ``loss = loss_fn(model, *batch)``,
``scaler.scale(loss / accumulation).backward()``; after ``accumulation`` micro-batches:
``scaler.unscale_(opt)`` -> optional ``clip_grad_norm_`` -> ``scaler.step(opt)`` ->
``scaler.update()`` -> ``opt.zero_grad(set_to_none=True)`` -> ``scheduler.step()`` unless the
step was skipped. GradScaler does the scaling, the inf/NaN check and the back-off; fxamp
adds nothing to them but bookkeeping.

**How a skipped step is detected.** ``scaler.step(opt)`` returns None both when it skips and
when the optimizer's ``step()`` returns None, so its return value says nothing, and comparing
``get_scale()`` before and after ``update()`` fails with ``backoff_factor=1`` and with
hysteresis. The trainer reads, after ``scaler.step`` and before ``scaler.update``, the
found-inf flags GradScaler recorded for this optimizer in ``unscale_``
(``scaler._found_inf_per_device(opt)``, the dict ``update()`` itself consumes) and tests the
same sum ``GradScaler.step`` tests. It is a private method (present since torch 1.6);
tests/test_train.py pins the behaviour. With the
scaler disabled (bfloat16) there is no scaling, and a step whose gradient norm is not finite
is skipped by the trainer itself.

**Hysteresis** (after DeepSpeed's ``consecutive_hysteresis=True``): with ``hysteresis=N`` the
first N-1 consecutive overflows skip the step but keep the scale: ``scaler.update()`` runs as
usual (back-off, growth tracker reset) and is followed by ``scaler.update(scale_before)``,
GradScaler's documented way to set the scale. The N-th consecutive overflow and every further
one back off; a finite step resets the count. ``min_scale`` raises
``ScaleUnderflowError`` once the scale falls below it (fp16 only: with bfloat16 the
scaler is disabled and ``min_scale`` raises at construction).

**No non-finite step is applied.** GradScaler checks the *scaled* gradients; after a long
run of overflows the scale can be so small (~1e-44) that its inverse is inf and the unscaled
gradients are inf/NaN although the scaled ones were finite. The trainer measures the total
norm of the unscaled gradients anyway (for clipping and the history); when it is not finite
and GradScaler found nothing, it sets GradScaler's found-inf flags so ``scaler.step`` skips
and ``update`` backs off. The scale never goes below ``SCALE_FLOOR`` (2**-24), so it can
grow back. After ``max_consecutive_skips`` (default 50) skipped steps in a row the trainer
raises ``TrainingDivergedError`` naming the node where the non-finite values start
(localised on the last batch) and what to do. ``state_dict()`` includes the RNG states
(``fxamp.train.rng``), so a resume with dropout is bit-identical.

**Overflow localisation and healing.** On a skipped step the micro-batches of the window are
replayed through the GraphModule in a ``torch.fx.Interpreter`` (first node whose output
is inf/NaN) with gradient hooks on every node output (first node, in backward order, whose
gradient is non-finite under the step's loss scale); see ``localize``. With
``heal=True`` a low-precision node that caused ``heal_after`` forward overflows is moved to
FP32: the original model is rewritten with the policy plus ``fp32:NODE``, the plan entry gets
``rule="heal"``, and the new GraphModule (same Parameters, so the optimizer carries on)
replaces ``trainer.gm``. Use ``trainer.gm`` for evaluation after healing.

**Distributed.** DDP: wrap the GraphModule, ``DistributedDataParallel(gm)``, and pass the DDP
module to the Trainer; micro-batches before the last of a window run under ``no_sync()``.
Gradients are all-reduced before ``unscale_``, so an inf on one rank is an inf on all; the
trainer also max-all-reduces the found-inf flags, so every rank makes the same skip decision
and the same scale update. FSDP: shards gradients, so each rank sees only its shard; use
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (a GradScaler subclass
that all-reduces found-inf itself) as ``scaler=``, and clip with FSDP's own
``model.clip_grad_norm_`` (pass ``clip_grad_norm=None``). FSDP is not tested here.
"""
from .localize import Overflow, localize
from .o2 import attach_optimizer, refresh_weights
from ..errors import TrainingDivergedError
from .skips import MAX_CONSECUTIVE_SKIPS, SCALE_FLOOR
from .trainer import ScaleUnderflowError, StepResult, Trainer

__all__ = ["Trainer", "StepResult", "Overflow", "ScaleUnderflowError", "TrainingDivergedError",
           "localize", "SCALE_FLOOR", "MAX_CONSECUTIVE_SKIPS", "attach_optimizer",
           "refresh_weights"]
