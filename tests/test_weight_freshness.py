"""Weights are never stale: whatever writes a weight (fused or foreach optimizers, writes
through ``.data``, ``load_state_dict``, ``copy_``), the next forward computes with the new
value, exactly as ``torch.autocast`` on the original model does. The default (weights=cast)
keeps no copy; weights=o2's copies are re-cast by the attached optimizer's step (fused ones
included) or ``fxamp.train.refresh_weights`` (weight_cache.py, train/o2.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.weight_cache import caches

BF16 = torch.bfloat16


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 2, 1, 0])


def _write(kind: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One weight update of the given kind, after backward."""
    params = list(model.parameters())
    if kind == "data_sub":  # a hand-written SGD step
        for p in params:
            p.data -= 0.05 * p.grad
    elif kind == "data_clamp":  # WGAN's weight clipping after the optimizer step
        opt.step()
        for p in params:
            p.data.clamp_(-0.1, 0.1)
    elif kind == "data_assign":
        for p in params:
            p.data = p.data - 0.05 * p.grad
    elif kind == "copy_":
        with torch.no_grad():
            for p in params:
                p.copy_(p - 0.05 * p.grad)
    elif kind == "load_state_dict":
        state = {k: v - 0.05 * p.grad for (k, v), p in
                 zip(model.state_dict().items(), params)}
        model.load_state_dict(state)
    else:
        opt.step()


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd_fused":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=kind == "adamw_fused",
                             foreach=kind == "adamw_foreach")


def _train(kind: str, policy: str | None, steps: int = 4):
    """Losses and final weights of fxamp and of autocast on a copy of the same model."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    gm = fxamp.amp_rewrite(model, (X,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy=policy))
    runs = []
    for mod, fn, autocast in ((model, gm, False), (ref, ref, True)):
        opt = _optimizer(kind, mod)
        if policy == "weights=o2" and not autocast:
            fxamp.train.attach_optimizer(gm, opt)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                loss = F.cross_entropy(fn(X).float(), Y)
            loss.backward()
            _write(kind, mod, opt)
            losses.append(loss.item())
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
            evaluated = fn(X).float()
        runs.append((losses, [p.detach().clone() for p in mod.parameters()], evaluated))
    return runs


WRITERS = ["adamw_fused", "sgd_fused", "adamw_foreach", "adamw", "data_sub", "data_clamp",
           "data_assign", "copy_", "load_state_dict"]


@pytest.mark.parametrize("kind", WRITERS)
def test_training_after_any_weight_write_equals_autocast(kind):
    (losses, params, out), (ref_losses, ref_params, ref_out) = _train(kind, None)
    assert ref_losses[-1] < ref_losses[0]  # the weights really move
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert torch.equal(out, ref_out)  # the eval forward after training sees the last write


@pytest.mark.parametrize("kind", ["adamw_fused", "sgd_fused", "adamw_foreach", "adamw"])
def test_o2_copies_follow_fused_and_foreach_optimizer_steps(kind):
    (losses, params, out), (ref_losses, ref_params, ref_out) = _train(kind, "weights=o2")
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert torch.equal(out, ref_out)


def _autocast_eval(model: nn.Module) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return model(X)


def test_default_keeps_no_copies_and_eval_after_any_weight_change_equals_autocast():
    """The default (weights=cast, also spelt out) holds no weight copy: every eval
    forward after an optimizer step (fused: no version bump), a write through ``.data`` or
    ``load_state_dict`` computes with the new weights, as autocast does."""
    for policy in (None, "weights=cast"):
        model = _mlp()
        gm = fxamp.amp_rewrite(model, (X,),
                               fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy=policy))
        assert not caches(gm) and not hasattr(gm, "fxamp_weight_cache")
        with torch.no_grad():
            gm(X)
            assert torch.equal(gm(X), _autocast_eval(model))
        assert fxamp.weight_cache_bytes(gm) == 0 and fxamp.train.refresh_weights(gm) == 0
        F.cross_entropy(gm(X).float(), Y).backward()
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True).step()  # no version bump
        with torch.no_grad():
            got = gm(X)
        assert torch.equal(got, _autocast_eval(model))
        model[0].weight.data.mul_(0.5)  # invisible to every counter
        with torch.no_grad():
            got = gm(X)
        assert torch.equal(got, _autocast_eval(model))
        model.load_state_dict(_mlp().state_dict())
        with torch.no_grad():
            got = gm(X)
        assert torch.equal(got, _autocast_eval(model))
        assert fxamp.weight_cache_bytes(gm) == 0


def test_o2_eval_forwards_reuse_copies_until_the_attached_optimizer_steps():
    model = _mlp()
    gm = fxamp.amp_rewrite(model, (X,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="weights=o2"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # no version bump
    fxamp.train.attach_optimizer(gm, opt)
    cache = caches(gm)[0]
    n = len(cache.slots)
    with torch.no_grad():
        gm(X)
        gm(X)
    assert cache.casts == n and cache.hits == n  # the inference gain is kept
    other = nn.Linear(2, 2)  # an optimizer over other weights changes nothing here
    other(torch.randn(1, 2)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    with torch.no_grad():
        gm(X)
    assert cache.casts == n
    F.cross_entropy(gm(X).float(), Y).backward()  # the copies serve the forward with grad
    assert cache.casts == n
    opt.step()  # the attached fused step re-casts every weight it owns
    assert cache.casts == 2 * n
    with torch.no_grad():
        got = gm(X)
    assert cache.casts == 2 * n
    assert torch.equal(got, _autocast_eval(model))


def test_a_copy_cast_in_training_is_not_reused_by_eval_after_a_data_write():
    model = _mlp()
    gm = fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    gm(X)  # a training forward casts the weights
    model[0].weight.data.mul_(0.5)  # no version bump, no optimizer
    with torch.no_grad():
        got = gm(X)
    assert torch.equal(got, _autocast_eval(model))


def test_refresh_weights_recasts_o2_copies_after_a_data_write_between_eval_forwards():
    model = _mlp()
    gm = fxamp.amp_rewrite(model, (X,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="weights=o2"))
    fxamp.train.attach_optimizer(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        gm(X)
        model[0].weight.data.mul_(0.5)  # invisible to every counter
        stale = gm(X)
        want = _autocast_eval(model)
        assert not torch.equal(stale, want)  # the copies do not see it (documented)
        assert fxamp.train.refresh_weights(gm) == len(caches(gm)[0].slots)
        got = gm(X)
    assert torch.equal(got, want)
