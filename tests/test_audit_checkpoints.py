"""The 12 AMP debugging checkpoints (README, audit section): each new audit finding code
triggered and not triggered, and the checkpoints that hold by construction shown."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.passes.audit.context import audit_context
from fxamp.policy import make_policy
from fxamp.train import Trainer

FP16 = make_policy(None, torch.float16, "cpu")
BF16 = make_policy(None, torch.bfloat16, "cpu")


def codes(findings):
    return sorted(f.code for f in findings)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


# -- optimizer: params-not-fp32, optimizer-eps-underflow, no-grad-scaler --------------------
def test_optimizer_over_fp16_params_with_tiny_eps():
    half = MLP().half()
    found = audit_context(half, FP16, optimizer=torch.optim.Adam(half.parameters(), eps=1e-8),
                          scaler=torch.amp.GradScaler("cpu"))
    assert codes(found) == ["optimizer-eps-underflow", "params-not-fp32"]
    assert [f.severity for f in found if f.code == "params-not-fp32"] == ["error"]
    ok = audit_context(half, FP16, optimizer=torch.optim.Adam(half.parameters(), eps=1e-4),
                       scaler=torch.amp.GradScaler("cpu"))
    assert codes(ok) == ["params-not-fp32"]  # eps 1e-4 is a normal fp16 number


def test_fp32_params_and_a_scaler_give_no_optimizer_findings():
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)  # eps is fine in FP32 state
    assert audit_context(model, FP16, optimizer=opt, scaler=torch.amp.GradScaler("cpu")) == []
    assert codes(audit_context(model, FP16, optimizer=opt)) == ["no-grad-scaler"]
    assert audit_context(model, BF16, optimizer=opt) == []  # bf16 needs no scaler


# -- scaler: scaler-disabled, scaler-growth-interval ----------------------------------------
def test_scaler_for_another_device_or_disabled():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available. Disabling" where none
        cuda_scaler = torch.amp.GradScaler("cuda")
    found = audit_context(MLP(), FP16, scaler=cuda_scaler)  # parameters on cpu
    assert codes(found) == ["scaler-disabled"]
    assert audit_context(MLP(), FP16, scaler=torch.amp.GradScaler("cpu")) == []
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert codes(audit_context(MLP(), FP16, scaler=off)) == ["scaler-disabled"]
    assert audit_context(MLP(), BF16, scaler=off) == []


def test_growth_interval_against_steps_per_epoch():
    scaler = torch.amp.GradScaler("cpu")  # growth_interval=2000
    found = audit_context(MLP(), FP16, scaler=scaler, steps_per_epoch=100)
    assert codes(found) == ["scaler-growth-interval"] and "2000" in found[0].message
    short = torch.amp.GradScaler("cpu", growth_interval=50)
    assert audit_context(MLP(), FP16, scaler=short, steps_per_epoch=100) == []
    assert audit_context(MLP(), FP16, scaler=scaler, steps_per_epoch=5000) == []


# -- batch: batch-low-precision, batch-out-of-range -----------------------------------------
def test_batch_checks():
    x = torch.randn(8, 16)
    assert audit_context(MLP(), FP16, batch=(x, torch.randint(0, 4, (8,)))) == []
    assert codes(audit_context(MLP(), FP16, batch=(x.half(),))) == ["batch-low-precision"]
    raw = audit_context(MLP(), FP16, batch=(x.abs() * 300,))  # unnormalised pixels
    assert codes(raw) == ["batch-out-of-range"] and raw[0].severity == "info"
    huge = audit_context(MLP(), FP16, batch={"x": x * 1e5})
    assert codes(huge) == ["batch-out-of-range"] and huge[0].severity == "warning"
    assert audit_context(MLP(), BF16, batch=(x * 1e5,))[0].severity == "info"  # bf16 range


# -- onnx: onnx-old-opset, onnx-static-batch ------------------------------------------------
def _export(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(MLP().eval(), (torch.randn(2, 16),), str(path), dynamo=False,
                          input_names=["x"], output_names=["y"], **kwargs)
    return str(path)


def test_onnx_opset_and_batch_axis(tmp_path):
    old = _export(tmp_path / "old.onnx", opset_version=11)
    assert codes(audit_context(None, FP16, onnx=old)) == ["onnx-old-opset",
                                                          "onnx-static-batch"]
    new = _export(tmp_path / "new.onnx", opset_version=17,
                  dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    assert audit_context(None, FP16, onnx=new) == []
    with pytest.raises(fxamp.FxampError, match="cannot read the ONNX file"):
        audit_context(None, FP16, onnx=str(tmp_path / "missing.onnx"))


@pytest.mark.slow
def test_cli_audit_onnx(tmp_path):
    old = _export(tmp_path / "old.onnx", opset_version=11)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-m", "fxamp", "audit", "fxamp.demo:small_cnn",
                        "--onnx", old], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"warning onnx-old-opset {old}: the file uses ONNX opset 11" in r.stdout
    assert f"info onnx-static-batch {old}: " in r.stdout


# -- through fxamp.audit --------------------------------------------------------------------
def test_audit_takes_the_context():
    torch.manual_seed(0)
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cuda")
    found = fxamp.audit(model, (torch.randn(4, 16),), "target=cpu",
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler,
                        batch=(torch.randn(4, 16).half(),), steps_per_epoch=10)
    assert {"scaler-disabled", "batch-low-precision"} <= set(codes(found))
    assert "runs-under-autocast" not in codes(found)  # all of it is traced


# -- output-low-precision (checkpoint 9) ----------------------------------------------------
def test_output_low_precision_only_when_outputs_are_kept_low():
    x = (torch.randn(4, 16),)
    kept = fxamp.audit(MLP(), x, "target=cpu,output=keep")
    assert codes(kept).count("output-low-precision") == 1
    assert "output-low-precision" not in codes(fxamp.audit(MLP(), x, "target=cpu"))
    gm = fxamp.amp_rewrite(
        MLP(), x, fxamp.RewriteConfig.make(target="cpu"))  # the default: FP32 outputs
    assert gm(*x).dtype == torch.float32


# -- holds by construction -------------------------------------------------------------------
class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)


def test_checkpoint1_a_loss_in_the_model_runs_in_fp32():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    gm = fxamp.amp_rewrite(WithLoss(), (x, y), fxamp.RewriteConfig.make(target="cpu"))
    plan = fxamp.plan_of(gm)
    assert plan.nodes["fc"].dtype == torch.float16
    assert plan.nodes["cross_entropy"].dtype == torch.float32


def test_checkpoint2_a_skipped_step_leaves_no_gradients_behind():
    torch.manual_seed(0)
    model = MLP()
    gm = fxamp.amp_rewrite(model, (torch.zeros(2, 16),), fxamp.RewriteConfig.make(target="cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.5e-44)  # its inverse is inf: skipped
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.1), scaler,
                      localize_on_skip=False)
    r = trainer.step(lambda m, a, b: F.cross_entropy(m(a), b), torch.randn(8, 16),
                     torch.randint(0, 4, (8,)))
    assert r.skipped
    assert all(p.grad is None for p in model.parameters())


class Normalize(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return self.conv((x - self.mean) / self.std)


def test_checkpoint5_normalisation_constants_stay_fp32():
    gm = fxamp.amp_rewrite(Normalize(), (torch.rand(1, 3, 8, 8),),
                           fxamp.RewriteConfig.make(target="cpu"))
    plan = fxamp.plan_of(gm)
    assert plan.nodes["sub"].dtype == torch.float32
    assert plan.nodes["truediv"].dtype == torch.float32
    assert plan.nodes["conv"].dtype == torch.float16


def test_checkpoint10_dropout_draws_what_autocast_draws():
    torch.manual_seed(0)
    model = MLP().train()
    x = torch.randn(8, 16)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    torch.manual_seed(1)
    got = gm(x)
    torch.manual_seed(1)
    with torch.autocast("cpu", torch.bfloat16):
        want = model(x).float()
    torch.testing.assert_close(got, want)
    torch.manual_seed(2)
    assert not torch.allclose(gm(x), want)  # another seed: another mask
