"""The weight helpers (``fxamp.train.refresh_weights``, ``fxamp.weight_cache_bytes``,
``fxamp.train.attach_optimizer``) take a model rewritten in place exactly as they take the
rewritten module it computes with (``fxamp.rewritten(model)``); with the default
``weights=cast`` there is nothing to refresh or count, and attaching is refused with the
policy that keeps copies."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.weight_cache import caches

BF16 = torch.bfloat16
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
Y = torch.tensor([0, 1, 2, 0])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _in_place(policy: str) -> nn.Module:
    model = _mlp()
    fxamp.amp_rewrite(model, (X,),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy=policy),
                      inplace=True)
    return model


def _bf16_bytes(model: nn.Module) -> int:
    return sum(p.numel() * 2 for p in model.parameters())  # every Linear weight and bias


@pytest.mark.parametrize("view", ["in place", "rewritten"])
def test_o2_weight_cache_bytes_and_refresh_weights_count_the_same_copies(view):
    model = _in_place("weights=o2")
    target = model if view == "in place" else fxamp.rewritten(model)
    assert fxamp.weight_cache_bytes(target) == 0  # nothing cast yet
    with torch.no_grad():
        model(X)
    assert fxamp.weight_cache_bytes(target) == _bf16_bytes(model) == 2 * 467
    assert fxamp.train.refresh_weights(target) == 6  # 3 weights, 3 biases


@pytest.mark.parametrize("view", ["in place", "rewritten"])
def test_refresh_weights_recasts_o2_copies_after_a_data_write(view):
    model, ref = _in_place("weights=o2"), _mlp()
    target = model if view == "in place" else fxamp.rewritten(model)
    with torch.no_grad():
        model(X)
        for p, q in zip(model.parameters(), ref.parameters()):
            p.data.mul_(-1.5)  # a write no version counter sees
            q.data.mul_(-1.5)
        assert fxamp.train.refresh_weights(target) == 6
        with torch.autocast("cpu", dtype=BF16):
            expected = ref(X)
        assert torch.equal(model(X), expected)


@pytest.mark.parametrize("view", ["in place", "rewritten"])
def test_the_attached_optimizer_step_recasts_o2_copies(view):
    model, ref = _in_place("weights=o2"), _mlp()
    target = model if view == "in place" else fxamp.rewritten(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    fxamp.train.attach_optimizer(target, opt)
    cache, = caches(model)
    assert caches(fxamp.rewritten(model)) == [cache] and cache.attached
    for _ in range(3):
        for m, o, amp in ((model, opt, False), (ref, ref_opt, True)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=BF16, enabled=amp):
                F.cross_entropy(m(X).float(), Y).backward()
        casts = cache.casts
        opt.step()
        ref_opt.step()
        assert cache.casts == casts + 6  # the step re-cast every copy (a fused step
        with torch.no_grad():            # bumps no version counter)
            with torch.autocast("cpu", dtype=BF16):
                expected = ref(X)
            assert torch.equal(model(X), expected)
        assert cache.casts == casts + 6  # the eval forward cast nothing
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("view", ["in place", "rewritten", "out of place"])
def test_default_cast_keeps_no_copies_and_attach_optimizer_says_to_use_o2(view):
    model = _mlp()
    if view == "out of place":
        target = fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    else:
        fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                          inplace=True)
        target = model if view == "in place" else fxamp.rewritten(model)
    target(X)
    with torch.no_grad():
        target(X)
    assert not caches(target)
    assert fxamp.weight_cache_bytes(target) == 0
    assert fxamp.train.refresh_weights(target) == 0
    with pytest.raises(fxamp.FxampError) as err:
        fxamp.train.attach_optimizer(target, torch.optim.SGD(model.parameters(), lr=0.1))
    text = str(err.value)
    assert "keeps no low-precision weight copies" in text
    assert "the default weights=cast" in text and "rewrite with policy weights=o2" in text
    assert "cached" not in text  # no longer a mode that keeps copies


def test_attach_optimizer_message_on_an_o2_model_that_casts_no_weight():
    """The other cause the refusal names: weights=o2 but every weight stays FP32."""
    model = nn.Sequential(nn.LayerNorm(8))  # LayerNorm runs in FP32 on the CPU list
    fxamp.amp_rewrite(model, (X,),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="weights=o2"),
                      inplace=True)
    with pytest.raises(fxamp.FxampError, match="casts no weight"):
        fxamp.train.attach_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_helpers_on_a_deepcopy_of_the_in_place_model():
    model = _in_place("weights=o2")
    with torch.no_grad():
        model(X)
    twin = copy.deepcopy(model)
    assert fxamp.weight_cache_bytes(twin) == 0  # copies are not copied
    with torch.no_grad():
        twin(X)
    assert fxamp.weight_cache_bytes(twin) == fxamp.weight_cache_bytes(model) > 0
    assert caches(twin) and caches(twin)[0] is not caches(model)[0]
