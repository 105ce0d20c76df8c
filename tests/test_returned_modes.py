"""A returned module (``amp_rewrite(model, example)``, not in place) whose model traces
differently in train and eval mode plans the other mode on its first call in it
(``rewriter/modes.py``): a train-then-validate loop runs, equal to the same loop under
``torch.autocast`` in both modes, with one set of weights and batch-norm statistics."""
from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

import fxamp
from fxamp.result import result_of

timm = pytest.importorskip("timm")

BF16 = torch.bfloat16
CONFIG = "compute=bf16,target=cpu"


def _step(model, x, autocast, opt):
    torch.manual_seed(1)  # (dropout)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = model(x)
    loss = out.float().logsumexp(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _validate(model, x, autocast):
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        return model(x)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["densenet121", "ghostnet_050"])
def test_a_returned_timm_model_trains_then_validates_like_autocast(name):
    torch.manual_seed(0)
    ref = timm.create_model(name, num_classes=5).train()
    model = copy.deepcopy(ref)
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    gm = fxamp.amp_rewrite(model, (x,), CONFIG)
    assert result_of(gm).mode is True  # (BatchNormAct2d: the modes trace differently)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(2):  # (train, validate, train again, validate again)
        assert torch.equal(_step(gm, x, False, opt), _step(ref, x, True, opt_ref))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
        gm.eval(), ref.eval()
        assert torch.equal(_validate(gm, x, False), _validate(ref, x, True))
        gm.train(), ref.train()
    for a, b in zip(model.buffers(), ref.buffers()):  # (the statistics both modes read)
        assert torch.equal(a, b)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)
        h = self.bn(h) if self.training else h * 0.5 + self.bn(h)  # (the modes trace apart)
        return self.head(h)


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _returned():
    torch.manual_seed(0)
    ref = _Net().train()
    gm = fxamp.amp_rewrite(copy.deepcopy(ref), (X,), CONFIG)
    assert result_of(gm).mode is True
    return ref, gm


def _eval_equal(gm, ref):
    gm.eval(), ref.eval()
    assert torch.equal(_validate(gm, X, False), _validate(ref, X, True))


def test_the_other_mode_is_planned_once_and_kept():
    ref, gm = _returned()
    gm.eval()
    gm(X)
    planned = result_of(gm).other_mode.graph(False)
    assert planned is not None
    gm(X)
    assert result_of(gm).other_mode.graph(False) is planned
    _eval_equal(gm, ref)


def test_a_copy_and_a_pickled_returned_module_plan_the_other_mode_too():
    ref, gm = _returned()
    _eval_equal(copy.deepcopy(gm), ref)
    ref.train()
    _eval_equal(pickle.loads(pickle.dumps(gm)), ref)


def test_threads_calling_in_the_other_mode_at_once_share_one_plan():
    ref, gm = _returned()
    gm.eval()
    got, errors = [], []

    def call():
        try:
            with torch.no_grad():
                got.append(gm(X))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ref.eval()
    want = _validate(ref, X, True)
    assert all(torch.equal(g, want) for g in got)


def test_planning_the_other_mode_leaves_the_models_flags_and_the_returned_modules_hooks():
    ref, gm = _returned()
    model = result_of(gm).other_mode.model
    seen = []
    gm.register_forward_hook(lambda m, a, out: seen.append(m.training))
    gm.eval()
    gm(X)
    assert seen == [False]  # (once: the hook runs around the call, not in the new graph)
    assert model.training  # (the root the returned module stands for: its flag stays)
    gm.train()
    gm(X)
    assert seen == [False, True]
