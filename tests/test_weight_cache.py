"""The default weights=cast (every forward casts, nothing kept)
and the apex-O2-style weights=o2, whose low-precision copies live between steps
(fxamp/weight_cache.py, train/o2.py): same numbers, same gradients on the FP32 masters,
fewer casts with o2."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.errors import FxampError, PolicyError
from fxamp.weight_cache import WeightCache, caches

BF16 = torch.bfloat16


class Net(nn.Module):
    """Embedding tied to the head, a conv, LayerNorm and two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.ln = nn.LayerNorm(16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.fc2(F.gelu(self.fc1(self.ln(h))))
        return F.linear(h, self.emb.weight)


def _pair(policy: str, dtype=BF16):
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    x = torch.randint(0, 50, (2, 7))
    ga = fxamp.amp_rewrite(a, (x,),
                           fxamp.RewriteConfig.make(dtype=dtype, target="cpu",
                                                    policy="weights=cast"))
    gb = fxamp.amp_rewrite(b, (x,),
                           fxamp.RewriteConfig.make(dtype=dtype, target="cpu", policy=policy))
    return a, ga, b, gb


def _launches(fn) -> dict:
    """aten::_to_copy and aten::_foreach_copy_ launches in ``fn()`` (torch profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    keys = ("aten::_to_copy", "aten::_foreach_copy_")
    counts = {k: 0 for k in keys}
    for e in prof.key_averages():
        if e.key in keys:
            counts[e.key] += e.count
    return counts


@pytest.mark.parametrize("policy", ["weights=cast", "weights=o2"])
def test_gradient_accumulation_grads_and_masters_identical_to_casting_every_forward(policy):
    a, ga, b, gb = _pair(policy)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    if policy == "weights=o2":
        fxamp.train.attach_optimizer(gb, opt_b)
    torch.manual_seed(1)
    for _ in range(2):  # optimizer steps
        for _ in range(3):  # micro-batches
            idx = torch.randint(0, 50, (2, 7))
            y = torch.randint(0, 50, (2 * 7,))
            for g in (ga, gb):
                F.cross_entropy(g(idx).reshape(-1, 50), y).backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert pb.grad.dtype == torch.float32
            assert torch.equal(pa.grad, pb.grad)
        opt_a.step(); opt_b.step()
        opt_a.zero_grad(); opt_b.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    if policy == "weights=cast":  # the default: no copies kept
        assert fxamp.Policy.parse(fxamp.plan_of(gb).policy).weights == "cast"
        assert not caches(gb)
        assert fxamp.weight_cache_bytes(gb) == 0
        return
    cache = caches(gb)[0]
    n_weights = len(cache.slots)
    # o2: the first forward casts every weight, each of the 2 steps re-casts them; the
    # other micro-batches reuse the copies (2 steps x 3 micro-batches, 2 of them hits)
    assert n_weights == 7 and cache.casts == (1 + 2) * n_weights
    assert cache.hits == 2 * 2 * n_weights


def test_o2_eval_loop_casts_weights_once_and_launches_fewer_casts():
    a, ga, b, gb = _pair("weights=o2")
    _, _, c, gc = _pair("weights=cast")  # the default: casts every forward
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        want = ga(x)
        first = _launches(lambda: gb(x))
        again = _launches(lambda: gb(x))
        plain = _launches(lambda: ga(x))
        default = [_launches(lambda: gc(x)) for _ in range(2)]
        assert torch.equal(gb(x), want) and torch.equal(gc(x), want)
    assert default == [plain, plain]
    n_weights = len(caches(gb)[0].slots)
    assert plain == {"aten::_to_copy": plain["aten::_to_copy"], "aten::_foreach_copy_": 0}
    # the first forward casts the 7 weights in one foreach copy, the next ones none
    assert first == {"aten::_to_copy": plain["aten::_to_copy"] - n_weights,
                     "aten::_foreach_copy_": 1}
    assert again == {"aten::_to_copy": plain["aten::_to_copy"] - n_weights,
                     "aten::_foreach_copy_": 0}
    assert again["aten::_to_copy"] > 0 and n_weights == 7


@pytest.mark.parametrize("change", ["optimizer", "load_state_dict", "data", "copy_",
                                    "new_parameter", "the_copy_itself"])
def test_a_changed_weight_is_cast_again(change):
    """weights=o2 without an optimizer re-casting the copies: eval forwards reuse them
    until the weight's version counter, storage or object changes, or the copy itself."""
    a, ga, b, gb = _pair("weights=o2")
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        gb(x)  # fill the cache
    other = Net()
    if change == "optimizer":
        for m in (a, b):
            m.fc1.weight.grad = torch.ones_like(m.fc1.weight)
            torch.optim.SGD(m.parameters(), lr=0.5).step()
    elif change == "load_state_dict":
        a.load_state_dict(other.state_dict()); b.load_state_dict(other.state_dict())
    elif change == "data":  # a new storage, the version counter is not bumped
        for m in (a, b):
            m.fc2.weight.data = other.fc2.weight.data.clone()
    elif change == "copy_":
        with torch.no_grad():
            a.conv.weight.copy_(other.conv.weight); b.conv.weight.copy_(other.conv.weight)
    elif change == "the_copy_itself":  # an in-place op on the cast weight (the cache's copy)
        with torch.no_grad():
            caches(gb)[0].slots[0].copy.mul_(2)
    else:  # the module now holds another Parameter object
        ga.fc1.weight = nn.Parameter(other.fc1.weight.clone())
        gb.fc1.weight = nn.Parameter(other.fc1.weight.clone())
    cache = caches(gb)[0]
    casts = cache.casts
    with torch.no_grad():
        assert torch.equal(gb(x), ga(x))
    changed = 7 if change == "load_state_dict" else 1
    assert cache.casts == casts + changed  # only the changed weights are cast again


def test_cache_made_under_inference_mode_serves_training():
    a, ga, b, gb = _pair("weights=o2")
    fxamp.train.attach_optimizer(gb, torch.optim.SGD(b.parameters(), lr=0.1))
    x = torch.randint(0, 50, (2, 7))
    with torch.inference_mode():
        assert torch.equal(gb(x), ga(x))
    cache = caches(gb)[0]
    casts = cache.casts
    gb(x).float().sum().backward()  # no "inference tensors cannot be saved for backward"
    assert cache.casts == casts  # the copies cast under inference_mode served it
    ga(x).float().sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)


def test_weight_cache_bytes_only_with_o2():
    a, ga, b, gb = _pair("weights=o2")
    x = torch.randint(0, 50, (2, 7))
    assert fxamp.weight_cache_bytes(gb) == 0  # nothing cast yet
    gb(x)
    eligible = sum(p.numel() * 2 for p in b.parameters() if p is not b.ln.weight
                   and p is not b.ln.bias)  # LayerNorm stays FP32 on the CPU list
    assert fxamp.weight_cache_bytes(gb) == eligible
    _, _, c, gc = _pair("weights=cast")  # the default
    for g in (ga, gc):  # the default keeps nothing, and has no cache submodule
        g(x)
        with torch.no_grad():
            g(x)
        assert fxamp.weight_cache_bytes(g) == 0 and not caches(g)
        assert not hasattr(g, "fxamp_weight_cache")
        assert "weights" not in str(fxamp.plan_of(g).policy)
    # dropped by deepcopy and pickling (they are rebuilt from the Parameters)
    assert fxamp.weight_cache_bytes(copy.deepcopy(gb)) == 0
    assert not any(s.copy is not None for s in pickle.loads(pickle.dumps(caches(gb)[0])).slots)


def test_policy_weights_field_and_string():
    p = fxamp.Policy.parse("compute=bf16,target=cpu,weights=o2")
    assert p.weights == "o2" and "weights=o2" in str(p)
    assert fxamp.Policy.parse(str(p)) == p
    assert fxamp.Policy().weights == "cast" and "weights" not in str(fxamp.Policy())
    with pytest.raises(PolicyError, match="weights takes cast, o2"):
        fxamp.Policy.parse("weights=cached")  # an older name of weights=cast, removed
    assert fxamp.Policy.parse("weights=cast") == fxamp.Policy()
    with pytest.raises(PolicyError, match="weights takes cast, o2"):
        fxamp.Policy.parse("weights=sometimes")


def test_o2_masters_bit_identical_with_grad_scaler_and_a_skipped_step():
    a, ga, b, gb = _pair("weights=o2", dtype=torch.float16)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) for _ in (a, b)]
    fxamp.train.attach_optimizer(gb, opts[1])
    cache = caches(gb)[0]
    torch.manual_seed(2)
    skipped = 0
    for step in range(5):
        idx = torch.randint(0, 50, (2, 7))
        y = torch.randint(0, 50, (2 * 7,))
        casts_before = cache.casts
        for g, m, opt, scaler in zip((ga, gb), (a, b), opts, scalers):
            loss = F.cross_entropy(g(idx).float().reshape(-1, 50), y)
            if step == 2:
                loss = loss * float("inf")  # every gradient inf: GradScaler skips this step
            scaler.scale(loss).backward()
            if g is gb and step > 0:  # the step wrote the copies: forward/backward cast none
                assert cache.casts == casts_before
            before = [p.detach().clone() for p in m.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 2:
                skipped += g is gb
                assert all(torch.equal(p, q) for p, q in zip(before, m.parameters()))
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), step
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert skipped == 1 and scalers[1].get_scale() < 2.0 ** 8
    with torch.no_grad():  # the copies the steps wrote are the casts of the masters
        assert torch.equal(gb(idx), ga(idx))


def test_o2_without_an_attached_optimizer_warns_and_stays_correct(caplog):
    a, ga, b, gb = _pair("weights=o2")
    x = torch.randint(0, 50, (2, 7))
    gb(x)
    with torch.no_grad():
        b.fc1.weight.add_(1.0)
        a.fc1.weight.add_(1.0)
    with caplog.at_level("WARNING", logger="fxamp.weight_cache"):
        out = gb(x)
    assert "attach_optimizer" in caplog.text
    assert torch.equal(out, ga(x))
    with pytest.raises(FxampError, match="weights=o2"):
        fxamp.train.attach_optimizer(ga, torch.optim.SGD(a.parameters(), lr=0.1))


def test_cache_steps_aside_on_meta_and_when_compiled():
    cache = WeightCache()
    cache.add_slot(BF16)
    from fxamp.weight_cache import cast_weight
    meta = nn.Parameter(torch.empty(3, 3, device="meta"))
    assert cast_weight(meta, BF16, cache, 0).dtype == BF16 and cache.casts == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_o2_step_recasts_only_copies_a_forward_uses(compiled):
    """Under torch.compile the cache steps aside (the compiled graph casts the weights
    itself), so the o2 optimizer hook has nothing to re-cast; eager, it re-casts every
    changed weight after each step. Masters equal the weights=cast model's either way."""
    a, ga, b, gb = _pair("weights=o2")
    run = torch.compile(gb, backend="eager") if compiled else gb
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    fxamp.train.attach_optimizer(gb, opts[1])
    cache = caches(gb)[0]
    torch.manual_seed(4)
    for step in range(3):
        idx = torch.randint(0, 50, (2, 7))
        y = torch.randint(0, 50, (2 * 7,))
        for g, opt in zip((ga, run), opts):
            F.cross_entropy(g(idx).reshape(-1, 50), y).backward()
            casts_before = cache.casts
            opt.step()
            opt.zero_grad()
            recast = cache.casts - casts_before
            if g is run:
                assert recast == (0 if compiled else len(cache.slots)), (step, recast)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), step
    assert (fxamp.weight_cache_bytes(gb) == 0) == compiled


def test_trainer_attaches_the_optimizer_for_o2():
    a, ga, b, gb = _pair("weights=o2")
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    trainer = fxamp.train.Trainer(gb, opt)
    x = torch.randint(0, 50, (2, 7))
    y = torch.randint(0, 50, (2 * 7,))
    trainer.step(lambda m, x, y: F.cross_entropy(m(x).reshape(-1, 50), y), x, y)
    cache = caches(gb)[0]
    assert cache.attached
    casts = cache.casts
    with torch.no_grad():
        gb(x)  # the step re-cast the copies: this forward casts no weight
    assert cache.casts == casts
