"""Planned on first call: ``amp_rewrite(model,
inplace=True)`` needs no example; each training mode and call structure no graph covers is
planned on its first call and kept; a returned module never runs a graph traced for another
mode (it plans that mode on its first call in it); planning leaves the user's RNG as it was and happens once, whichever
thread calls (rewriter/inplace.py)."""
from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import ModeError, NotPlannedError
from fxamp.result import result_of, set_result

BF16 = torch.bfloat16


class ModeBranch(nn.Module):
    """Train and eval trace differently: no read of ``training`` becomes a flag."""

    def forward(self, x):
        if self.training:
            return x * 2
        return x.relu()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.branch = ModeBranch()
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.drop(self.branch(self.fc(x))))


def _pair(cls=Net):
    torch.manual_seed(0)
    ref = cls()
    return ref, copy.deepcopy(ref)


def _autocast(model, *args, **kwargs):
    with torch.autocast("cpu", dtype=BF16):
        return model(*args, **kwargs)


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_a_returned_module_plans_the_mode_its_graph_was_not_traced_for_on_its_first_call():
    ref, model = _pair()
    gm = fxamp.amp_rewrite(model.train(), (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    assert result_of(gm).mode is True
    gm.eval(), ref.eval()
    assert torch.equal(gm(X), _autocast(ref, X))  # (the train graph would give x * 2)
    gm.train(), ref.train()
    torch.manual_seed(1)
    got = gm(X)
    torch.manual_seed(1)
    assert torch.equal(got, _autocast(ref, X))


def test_a_module_with_a_one_mode_graph_and_no_planner_refuses_naming_the_model():
    ref, model = _pair()
    gm = fxamp.amp_rewrite(model.train(), (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    set_result(gm, result_of(gm).replace(other_mode=None))
    gm.eval()
    with pytest.raises(ModeError, match="^Net was called in eval mode.*train mode only"):
        gm(X)


def test_in_place_eval_after_train_computes_with_an_eval_graph():
    ref, model = _pair()
    fxamp.amp_rewrite(model.train(), (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    torch.manual_seed(1)
    got = model(X)
    torch.manual_seed(1)
    assert torch.equal(got, _autocast(ref.train(), X))
    model.eval(), ref.eval()
    assert torch.equal(model(X), _autocast(ref, X))  # (before: the train graph, x * 2)
    model.train(), ref.train()
    torch.manual_seed(2)
    got = model(X)
    torch.manual_seed(2)
    assert torch.equal(got, _autocast(ref, X))


def test_no_example_plans_on_the_first_call_and_says_so_before():
    ref, model = _pair()
    assert fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                             inplace=True) is model
    with pytest.raises(NotPlannedError, match="planned on its first call"):
        fxamp.plan_of(model)
    with pytest.raises(NotPlannedError):
        fxamp.rewritten(model)
    assert fxamp.config_of(model).policy.compute == BF16
    model.eval(), ref.eval()
    assert torch.equal(model(X), _autocast(ref, X))
    assert "fc" in fxamp.plan_of(model).to_text()


def test_no_example_trains_like_autocast_from_step_0_with_the_rng_untouched():
    """Dropout draws from the global RNG: the first step (which plans) and the next ones
    draw exactly what autocast's steps draw, and the gradients are bit-identical."""
    ref, model = _pair()
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    opt_a = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(10 + step)
        loss_a = _autocast(ref, X).float().pow(2).mean()
        loss_a.backward()
        after_a = torch.rand(1)
        torch.manual_seed(10 + step)
        loss_b = model(X).float().pow(2).mean()
        loss_b.backward()
        after_b = torch.rand(1)
        assert torch.equal(after_a, after_b), step  # (the RNG where autocast's is)
        assert torch.equal(loss_a, loss_b), step
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), (step, name)
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()


def test_a_returned_module_still_needs_an_example():
    _, model = _pair()
    with pytest.raises(fxamp.FxampError, match="inplace=True"):
        fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.fc(x).relu())


def _race(model, ref, threads=6, rounds=1):
    """Call ``model`` from ``threads`` threads at once; every output must be autocast's."""
    want = _autocast(ref, X)
    outs, errors = [], []
    barrier = threading.Barrier(threads)

    def call():
        try:
            barrier.wait()
            with torch.no_grad():
                outs.append(model(X))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    pool = [threading.Thread(target=call) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert not errors, errors
    assert len(outs) == threads
    for out in outs:
        assert type(out) is torch.Tensor and torch.equal(out, want)


@pytest.mark.skipif(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 11),
                    reason="torch 2.10 segfaults in FakeTensorMode.__enter__ when a thread "
                           "other than the main one plans while others wait (2.11+ do not)")
@pytest.mark.parametrize("round_", range(20))
def test_first_call_planning_races_plan_once_and_answer_with_the_plan(round_, caplog):
    ref, model = _pair(Plain)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    with caplog.at_level(logging.INFO, logger="fxamp"):
        _race(model, ref)
    assert caplog.text.count("planning it on this call") == 1


@pytest.mark.parametrize("round_", range(20))
def test_replanning_races_plan_once_and_never_run_the_fp32_forward(round_, caplog):
    """After ``model.head = nn.Linear(...)`` the threads that race the re-plan wait for it
    and compute with the new plan (before: the plain FP32 forward, planned up to 6 times,
    or an error naming the wrong cause)."""
    ref, model = _pair(Plain)
    fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    torch.manual_seed(3)
    ref.head = nn.Linear(8, 4)
    model.head = copy.deepcopy(ref.head)
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        _race(model, ref)
    assert caplog.text.count("planning it again") == 1
