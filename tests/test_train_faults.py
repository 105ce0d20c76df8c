"""The trainer never applies a non-finite step, stops on endless skips, resumes RNG exactly."""
import io
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.train import SCALE_FLOOR, Trainer, TrainingDivergedError


class DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def make(seed=0, dtype=torch.float16):
    torch.manual_seed(seed)
    model = DropMLP()
    gm = fxamp.amp_rewrite(model, (torch.zeros(2, 16),),
                           fxamp.RewriteConfig.make(dtype=dtype, target="cpu"))
    return model, gm


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def nan_batch(x):
    x = x.clone()
    x[0, 0] = float("nan")
    return x


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def all_finite(model):
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.slow
def test_a_long_nan_run_then_good_batches_keep_the_weights_finite_and_recover():
    model, gm = make()
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), scaler,
                      max_consecutive_skips=None, localize_on_skip=False)
    (x, y), = data(1)
    for _ in range(160):  # the run: the scale used to fall to 4.5e-44
        assert trainer.step(loss_fn, nan_batch(x), y).skipped
    assert trainer.scale == SCALE_FLOOR
    r = trainer.step(loss_fn, x, y)  # the first good batch: finite (before: nan weights)
    assert not r.skipped and r.grad_norm == r.grad_norm and all_finite(model)
    before = params(model)
    for _ in range(30):  # the scale grows back (growth_interval=1) and training resumes
        r = trainer.step(loss_fn, x, y)
    assert not r.skipped and r.grad_norm > 0 and trainer.scale > 1 and all_finite(model)
    assert not all(torch.equal(a, b) for a, b in zip(before, params(model)))


def test_a_step_whose_unscaled_gradients_are_not_finite_is_skipped():
    model, gm = make()
    # the scale 160 back-offs from 2**16 reach: its inverse is inf in float32
    scaler = torch.amp.GradScaler("cpu", init_scale=4.5e-44)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), scaler,
                      localize_on_skip=False)
    (x, y), = data(1)
    before = params(model)
    r = trainer.step(loss_fn, x, y)  # a good batch: GradScaler sees finite scaled gradients
    assert r.skipped and r.grad_norm != r.grad_norm  # nan
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))
    assert trainer.scale == SCALE_FLOOR  # backed off, then held at the floor
    r = trainer.step(loss_fn, x, y)
    assert not r.skipped and all_finite(model)


@pytest.mark.parametrize("dtype, localize, node", [(torch.float16, True, "fc1"),
                                                   (torch.float16, False, "fc1"),
                                                   (torch.bfloat16, True, "x")])
def test_consecutive_skips_raise_naming_the_node(dtype, localize, node):
    model, gm = make(dtype=dtype)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), max_consecutive_skips=3,
                      localize_on_skip=localize)
    (x, y), (x2, y2) = data(2)
    # fp16: 6e4 is finite but fc1 overflows; bf16 (float32's range): a NaN in the input
    bad = x * 6e4 if dtype == torch.float16 else nan_batch(x)
    assert trainer.step(loss_fn, bad, y).skipped
    assert not trainer.step(loss_fn, x2, y2).skipped  # a good step resets the count
    before = params(model)
    trainer.step(loss_fn, bad, y)
    trainer.step(loss_fn, bad, y)
    with pytest.raises(TrainingDivergedError, match=r"(?s)^3 optimizer steps in a row were skipped "
                       r"\(steps 2-4\).*unchanged since step 1\n  where it starts: forward "
                       rf"overflow .*node '{node}'.*\n  what to do: .*check the data") as err:
        trainer.step(loss_fn, bad, y)
    assert isinstance(err.value, fxamp.FxampError)
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))
    assert trainer.consecutive_skips == 3 and trainer.skipped_steps == 4


def test_min_scale_with_bf16_raises():
    model, gm = make(dtype=torch.bfloat16)
    with pytest.raises(fxamp.FxampError, match=r"min_scale=1 has no effect: the GradScaler is "
                       r"disabled \(the plan computes in torch.bfloat16"):
        Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), min_scale=1.0)


def _run(trainer, batches):
    for x, y in batches:
        trainer.step(loss_fn, x, y)
        # the user's own randomness between steps (augmentation, sampling) uses them too
        random.random()
        np.random.rand()


@pytest.mark.slow
def test_resume_with_dropout_is_bit_identical(tmp_path):
    batches = data(8)
    model, gm = make()
    trainer = Trainer(gm, torch.optim.Adam(model.parameters(), lr=1e-2))
    _run(trainer, batches[:4])
    buf = io.BytesIO()
    torch.save(trainer.state_dict(), buf)
    _run(trainer, batches[4:])
    expected = params(model)

    results = {}
    for restore in (True, False):
        model2, gm2 = make(seed=1)
        trainer2 = Trainer(gm2, torch.optim.Adam(model2.parameters(), lr=1e-2))
        torch.manual_seed(123)
        random.seed(123)
        np.random.seed(123)
        buf.seek(0)
        trainer2.load_state_dict(torch.load(buf), restore_rng=restore)  # weights_only
        _run(trainer2, batches[4:])
        results[restore] = params(model2)
    assert all(torch.equal(a, b) for a, b in zip(expected, results[True]))
    # without the RNG states the dropout masks differ: the test can tell
    assert not all(torch.equal(a, b) for a, b in zip(expected, results[False]))
