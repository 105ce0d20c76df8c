"""fxamp.train: Trainer around GradScaler, overflow localisation, healing, checkpoints, DDP.

Real data: scikit-learn's digits (8x8 images, 10 classes), a small MLP, FP16 with
target="cpu" (FP16 matmuls on CPU are slow, so the models are small).
"""
import copy
import importlib
import io
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.train import ScaleUnderflowError, Trainer

import sklearn.datasets as sklearn_datasets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HUGE = 6e4  # an input this large overflows fp16 after the first linear layer


class MLP(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        h = self.fc1(x)
        h = torch.relu(self.norm(h))
        return self.fc2(h)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.fixture(scope="module")
def digits():
    data = sklearn_datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[360:], y[360:]), (x[:360], y[:360])


def batches(x, y, size, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < n:
        perm = torch.randperm(len(x), generator=g)
        out += [(x[perm[i:i + size]], y[perm[i:i + size]])
                for i in range(0, len(x) - size + 1, size)]
    return out[:n]


def poisoned(x):
    x = x.clone()
    x[0] = HUGE
    return x


def make(seed=0, dtype=torch.float16, hidden=32, **kwargs):
    torch.manual_seed(seed)
    model = MLP(hidden)
    example = (torch.zeros(2, 64),)
    gm = fxamp.amp_rewrite(model, example, fxamp.RewriteConfig.make(dtype=dtype, target="cpu"))
    return model, example, gm


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


# --------------------------------------------------------------------------- accuracy
@pytest.mark.slow
def test_fp32_autocast_and_fxamp_reach_the_same_accuracy(digits):
    (xtr, ytr), (xte, yte) = digits
    data = batches(xtr, ytr, 32, 180)  # 4 epochs of 45 batches
    torch.manual_seed(0)
    init = MLP(64)

    def fresh():
        model = copy.deepcopy(init)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, opt = fresh()  # FP32
    for x, y in data:
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    acc_fp32 = accuracy(model, xte, yte)

    model, opt = fresh()  # torch.autocast("cpu", float16) + GradScaler
    scaler = torch.amp.GradScaler("cpu")
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        acc_autocast = accuracy(model, xte, yte)

    model, opt = fresh()  # fxamp
    gm = fxamp.amp_rewrite(model, (xtr[:2],),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))
    trainer = Trainer(gm, opt)
    for x, y in data:
        trainer.step(loss_fn, x, y)
    acc_fxamp = accuracy(trainer.gm, xte, yte)
    print(f"test accuracy: fp32 {acc_fp32:.4f} autocast {acc_autocast:.4f} "
          f"fxamp {acc_fxamp:.4f}; {trainer.summary()}")
    assert acc_fp32 > 0.9
    assert abs(acc_fxamp - acc_fp32) <= 0.02
    assert abs(acc_fxamp - acc_autocast) <= 0.02
    assert trainer.steps == len(data) and len(trainer.scale_history) == len(data)


# --------------------------------------------------------------------------- overflow
def test_injected_overflow_is_skipped_backed_off_and_localised(digits):
    (xtr, ytr), _ = digits
    model, example, gm = make()
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), record_grad_stats=True)
    (x, y), (x2, y2) = batches(xtr, ytr, 16, 2)
    assert not trainer.step(loss_fn, x, y).skipped
    before, scale = params(model), trainer.scale
    r = trainer.step(loss_fn, poisoned(x2), y2)
    assert r.skipped and r.stepped
    assert same(before, params(model)), "a skipped step must not change any parameter"
    assert r.scale == trainer.scale == scale / 2
    assert trainer.skipped_steps == 1 and trainer.steps == 2
    assert r.overflow.phase == "forward" and r.overflow.node == "fc1"
    assert r.overflow.module == "fc1" and r.overflow.dtype == torch.float16
    assert "test_train.py" in r.overflow.source and "self.fc1(x)" in r.overflow.source
    assert r.grad_stats["fc1.weight"]["nan"] + r.grad_stats["fc1.weight"]["inf"] > 0
    assert not any(p.grad is not None for p in model.parameters())  # zero_grad(set_to_none)
    assert not trainer.step(loss_fn, x, y).skipped
    assert not same(before, params(model))


def test_backward_overflow_names_the_last_fp16_node(digits):
    (xtr, ytr), _ = digits
    model, _, gm = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    (x, y), = batches(xtr, ytr, 16, 1)
    before = params(model)
    r = trainer.step(loss_fn, x, y)
    assert r.skipped and same(before, params(model)) and r.scale == 2.0 ** 59
    assert r.overflow.phase == "backward" and r.overflow.node == "fc2"
    # on demand, at a sane scale, the same batch is finite
    assert not trainer.localize(loss_fn, x, y, scale=1024.0).found


def test_localize_on_demand_and_trainer_telemetry(digits):
    (xtr, ytr), _ = digits
    model, _, gm = make()

    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    writer = Writer()
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), tensorboard=writer)
    (x, y), = batches(xtr, ytr, 16, 1)
    ov = trainer.localize(loss_fn, poisoned(x), y)
    assert ov.node == "fc1" and "fc1" in str(ov)
    trainer.step(loss_fn, x, y)
    trainer.step(loss_fn, poisoned(x), y)
    assert trainer.grad_norm_history[0] > 0 and trainer.grad_norm_history[1] != \
        trainer.grad_norm_history[1]  # nan on the skipped step
    tags = {t for t, _, _ in writer.scalars}
    assert {"fxamp/loss_scale", "fxamp/grad_norm", "fxamp/skipped"} <= tags
    assert ("fxamp/skipped", 1.0, 1) in writer.scalars
    assert "1 skipped" in trainer.summary()


def test_tensorboard_logdir_is_optional(digits, tmp_path):
    (xtr, ytr), _ = digits
    model, _, gm = make()
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1),
                      tensorboard=str(tmp_path / "tb"))
    (x, y), = batches(xtr, ytr, 16, 1)
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError:
        with pytest.warns(UserWarning, match="TensorBoard logging is off"):
            trainer.step(loss_fn, x, y)
        trainer.step(loss_fn, x, y)  # warned once, then silent
    else:
        trainer.step(loss_fn, x, y)
        assert any((tmp_path / "tb").iterdir())


def test_min_scale_raises_instead_of_training_at_scale_zero(digits):
    (xtr, ytr), _ = digits
    model, _, gm = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), scaler, min_scale=2.0)
    (x, y), = batches(xtr, ytr, 16, 1)
    assert trainer.step(loss_fn, poisoned(x), y).scale == 4.0
    assert trainer.step(loss_fn, poisoned(x), y).scale == 2.0
    with pytest.raises(ScaleUnderflowError, match=r"min_scale=2.*fc1") as err:
        trainer.step(loss_fn, poisoned(x), y)
    assert isinstance(err.value, fxamp.FxampError)


@pytest.mark.slow
def test_hysteresis_tolerates_consecutive_overflows(digits):
    (xtr, ytr), _ = digits
    model, _, gm = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), scaler, hysteresis=3,
                      localize_on_skip=False)
    (x, y), = batches(xtr, ytr, 16, 1)
    bad = poisoned(x)
    scales = []
    for batch in (bad, bad, bad, bad, x, bad, bad, bad):
        before = params(model)
        r = trainer.step(loss_fn, batch, y)
        assert r.skipped == (batch is bad)
        assert same(before, params(model)) == r.skipped
        scales.append(r.scale)
    assert scales == [1024, 1024, 512, 256, 256, 256, 256, 128]
    assert trainer.skipped_steps == 7


def test_accumulation_steps_once_per_window(digits):
    (xtr, ytr), _ = digits
    data = batches(xtr, ytr, 8, 8)
    model, _, gm = make()
    ref_model = copy.deepcopy(model)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=4)
    results = []
    for i, (x, y) in enumerate(data):
        before = params(model)
        results.append(trainer.step(loss_fn, x, y))
        assert same(before, params(model)) == (i % 4 != 3)
    assert [r.stepped for r in results] == [False, False, False, True] * 2
    assert trainer.steps == 2 and trainer.micro_steps == 8
    # same as one step per concatenated batch (mean of equal-size micro-batch means)
    ref_gm = fxamp.amp_rewrite(ref_model, (torch.zeros(2, 64),),
                               fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))
    ref = Trainer(ref_gm, torch.optim.SGD(ref_model.parameters(), lr=0.1))
    for k in (0, 4):
        ref.step(loss_fn, torch.cat([x for x, _ in data[k:k + 4]]),
                 torch.cat([y for _, y in data[k:k + 4]]))
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_scheduler_is_not_stepped_on_a_skipped_step(digits):
    (xtr, ytr), _ = digits
    model, _, gm = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = Trainer(gm, opt, scheduler=sched, localize_on_skip=False)
    (x, y), = batches(xtr, ytr, 16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        trainer.step(loss_fn, x, y)
        assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
        assert trainer.step(loss_fn, poisoned(x), y).skipped
        assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
        trainer.step(loss_fn, x, y)
        assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.025


def test_bf16_without_scaler_still_skips_non_finite_gradients(digits):
    (xtr, ytr), _ = digits
    model, _, gm = make(dtype=torch.bfloat16)
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not trainer.scaler.is_enabled() and trainer.scale == 1.0
    (x, y), = batches(xtr, ytr, 16, 1)
    assert not trainer.step(loss_fn, x, y).skipped
    x = x.clone()
    x[0, 0] = float("nan")
    before = params(model)
    r = trainer.step(loss_fn, x, y)
    assert r.skipped and same(before, params(model))
    assert r.overflow.phase == "forward" and r.overflow.node == "x"  # the input itself


# --------------------------------------------------------------------------- healing
def test_heal_moves_the_overflowing_node_to_fp32(digits):
    (xtr, ytr), _ = digits
    model, example, gm = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fxamp.FxampError, match="original_model"):
        Trainer(gm, opt, heal=True)
    trainer = Trainer(gm, opt, heal=True, heal_after=2, original_model=model,
                      example_inputs=example)
    (x, y), = batches(xtr, ytr, 16, 1)
    bad = poisoned(x)
    assert trainer.step(loss_fn, bad, y).healed == ""
    r = trainer.step(loss_fn, bad, y)
    assert r.skipped and r.healed == "fc1"
    assert trainer.gm is not gm
    entry = fxamp.plan_of(trainer.gm).nodes["fc1"]
    assert entry.dtype == torch.float32 and entry.rule == "heal"
    assert "fp32:fc1" in trainer.plan.policy
    assert fxamp.plan_of(trainer.gm).nodes["fc2"].dtype == torch.float16
    before = params(model)
    r = trainer.step(loss_fn, bad, y)  # fc1 now in fp32: the batch trains
    assert not r.skipped and not same(before, params(model))
    # same Parameters: the optimizer keeps training the original model
    assert {id(p) for p in trainer.gm.parameters()} == {id(p) for p in model.parameters()}


# --------------------------------------------------------------------------- checkpoint
def _run(trainer, data, bad_steps=(), nan_steps=()):
    for i, (x, y) in enumerate(data):
        if i in bad_steps:
            x = poisoned(x)
        if i in nan_steps:
            x = x.clone()
            x[0, 0] = float("nan")
        trainer.step(loss_fn, x, y)


def _trainer(seed, **kwargs):
    model, example, gm = make(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    trainer = Trainer(gm, opt, scaler, scheduler=sched, hysteresis=2, clip_grad_norm=1.0,
                      heal=True, heal_after=3, original_model=model, example_inputs=example,
                      **kwargs)
    return model, trainer


@pytest.mark.slow
def test_checkpoint_resume_continues_bitwise_identically(digits):
    (xtr, ytr), _ = digits
    data = batches(xtr, ytr, 16, 18)
    first, rest = data[:10], data[10:]
    model, trainer = _trainer(0)
    # steps 2, 3: hysteresis tolerates one overflow, backs off on the second; step 6: the
    # third overflow of fc1 heals it; step 9: a NaN input (not healable) leaves a pending
    # hysteresis count in the checkpoint
    _run(trainer, first, bad_steps=(2, 3, 6), nan_steps=(9,))
    assert list(trainer.healed) == ["fc1"] and trainer.skipped_steps == 4
    assert trainer.consecutive_overflows == 1
    buf = io.BytesIO()
    torch.save(trainer.state_dict(), buf)
    _run(trainer, rest, bad_steps=(4,), nan_steps=(0, 6))
    assert trainer.skipped_steps == 6
    expected = params(model)

    model2, trainer2 = _trainer(1)  # different init: everything comes from the checkpoint
    buf.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plan must match (the healed node is restored)
        trainer2.load_state_dict(torch.load(buf))  # weights_only=True loads it
    assert trainer2.plan.to_text() == fxamp.plan_of(trainer.gm).to_text()
    _run(trainer2, rest, bad_steps=(4,), nan_steps=(0, 6))
    assert same(expected, params(model2))
    assert trainer2.scale_history == trainer.scale_history
    assert list(map(repr, trainer2.grad_norm_history)) == \
        list(map(repr, trainer.grad_norm_history))  # nan on skipped steps
    assert (trainer2.steps, trainer2.skipped_steps) == (trainer.steps, trainer.skipped_steps)


# --------------------------------------------------------------------------- DDP
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scaler():
    # each rank's local gradient is that of a mean over half the batch (twice the size of the
    # single-process one) and can overflow fp16 at 65536 where the single process does not;
    # start lower so only the injected inf overflows
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)


def _ddp_worker(rank, world, port, data, bad_step, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, _, gm = make()
        ddp = nn.parallel.DistributedDataParallel(gm)
        trainer = Trainer(ddp, torch.optim.SGD(model.parameters(), lr=0.1), _scaler())
        record = []
        for step, (x, y) in enumerate(data):
            n = len(x) // world
            x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
            if step == bad_step and rank == 1:
                x = poisoned(x)
            r = trainer.step(loss_fn, x, y)
            record.append((r.loss, r.skipped, r.scale))
        torch.save({"record": record, "params": params(model)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_processes_match_single_process(digits, tmp_path):
    (xtr, ytr), _ = digits
    data = batches(xtr, ytr, 16, 3)
    bad_step = 1
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), data, bad_step,
                                                   str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    model, _, gm = make()  # one process over the global batch
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), _scaler())
    single = []
    for step, (x, y) in enumerate(data):
        if step == bad_step:
            x = x.clone()
            x[len(x) // 2] = HUGE  # rank 1's first sample
        r = trainer.step(loss_fn, x, y)
        single.append((r.loss, r.skipped, r.scale))

    for step in range(len(data)):
        skipped = [rank["record"][step][1] for rank in ranks]
        assert skipped == [step == bad_step] * 2, "both ranks must make the same skip decision"
        assert ranks[0]["record"][step][2] == ranks[1]["record"][step][2] == single[step][2]
        if step != bad_step:
            mean = (ranks[0]["record"][step][0] + ranks[1]["record"][step][0]) / 2
            assert mean == pytest.approx(single[step][0], rel=1e-3)
    for a, b, c in zip(ranks[0]["params"], ranks[1]["params"], model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c.detach(), rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------- example
@pytest.mark.slow
def test_train_digits_example_runs():
    r = subprocess.run([sys.executable, "examples/train_digits.py", "--epochs", "2",
                        "--inject-overflow"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr
    acc = float(re.search(r"test accuracy: (\d\.\d+)\s*$", r.stdout).group(1))
    assert acc > 0.85, r.stdout
    assert "skipped step 3: forward overflow" in r.stdout and "node 'fc1'" in r.stdout
    assert "healed: node 'fc1'" in r.stdout
