"""Errors name the real cause: example inputs, tracing advice, conflicting dtypes."""
import logging

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import ExampleInputError
from fxamp.errors import FxampError, PolicyError, TraceError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).relu()


def test_wrong_shape_is_reported_as_the_models_own_error(capfd):
    with pytest.raises(ExampleInputError) as info:
        fxamp.amp_rewrite(Net(), (torch.randn(4, 5),), fxamp.RewriteConfig.make(target="cpu"))
    text = str(info.value)
    assert "mat1 and mat2 shapes cannot be multiplied (4x5 and 8x8)" in text
    assert "test_errors_cause.py" in text and "self.lin(x)" in text  # the model's line
    assert "planned dtypes" not in text and "fp32:" not in text
    assert capfd.readouterr().err == ""


def test_empty_example_inputs_name_the_missing_argument(capfd):
    with pytest.raises(ExampleInputError, match="missing 1 required positional argument") \
            as info:
        fxamp.amp_rewrite(Net(), (), fxamp.RewriteConfig.make(target="cpu"))
    assert "tlparse" not in str(info.value)
    assert not getattr(info.value, "__notes__", None)
    assert capfd.readouterr().err == ""


def test_fake_run_failure_on_a_meta_model_prints_no_torch_logs(capfd):
    model = Net().to("meta")  # nothing runs on meta: the inputs are checked by the fake run
    with pytest.raises(FxampError) as info:
        fxamp.amp_rewrite(model, (torch.randn(4, 5, device="meta"),),
                          fxamp.RewriteConfig.make(target="cpu"))
    assert not any("tlparse" in note for note in getattr(info.value, "__notes__", []))
    assert capfd.readouterr().err == ""


class Branchy(nn.Module):
    """Value-dependent control flow in the model's own forward, no children to rewrite."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_auto_never_advises_the_front_end_in_use():
    with pytest.raises(TraceError) as info:
        fxamp.amp_rewrite(Branchy(), (torch.randn(2, 3),), fxamp.RewriteConfig.make(target="cpu"))
    text = str(info.value)
    assert "frontend='auto'" not in text
    assert "- fx:" in text and "- export:" in text and "torch.where" in text


def test_fx_error_advises_auto():
    with pytest.raises(TraceError, match="frontend='auto'"):
        fxamp.amp_rewrite(Branchy(), (torch.randn(2, 3),),
                          fxamp.RewriteConfig.make(target="cpu", frontend="fx"))


def test_conflicting_dtype_and_compute_raise_policy_error():
    x = (torch.randn(2, 8),)
    with pytest.raises(PolicyError, match="conflicts with the policy's compute=bf16"):
        fxamp.amp_rewrite(Net(), x,
                          fxamp.RewriteConfig.make(dtype=torch.float16, policy="compute=bf16",
                                                   target="cpu"))
    gm = fxamp.amp_rewrite(Net(), x, fxamp.RewriteConfig.make(policy="compute=bf16", target="cpu"))
    assert fxamp.plan_of(gm).header["policy"].startswith("compute=bf16")
    gm = fxamp.amp_rewrite(Net(), x,
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, policy="compute=bf16",
                                                    target="cpu"))
    assert gm(*x).dtype == torch.float32


@pytest.mark.slow
def test_cli_takes_compute_from_the_policy_and_refuses_a_conflict():
    import subprocess
    import sys
    from pathlib import Path

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fxamp", "plan", "fxamp.demo:small_cnn",
                               *args], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])

    ok = cli("--policy", "compute=bf16,target=cpu")
    assert ok.returncode == 0, ok.stderr
    assert "# policy: compute=bf16,target=cpu" in ok.stdout
    bad = cli("--dtype", "fp16", "--policy", "compute=bf16,target=cpu")
    assert bad.returncode == 2
    assert "conflicts with the policy's compute=bf16" in bad.stderr
    assert "Traceback" not in bad.stderr


class _OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        y = self.a(x)
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y


def test_a_none_default_left_out_of_the_example_is_traced_as_none():
    model = _OptionalMask()
    x = torch.randn(2, 4)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(frontend="fx", target="cpu",
                                                    dtype=torch.bfloat16))
    with torch.autocast("cpu", torch.bfloat16):
        want = model(x)
    assert torch.equal(gm(x).float(), want.float())
    with pytest.raises(fxamp.CallStructureError, match="'mask' a tensor"):
        gm(x, torch.zeros(2, 4, dtype=torch.bool))  # (a mask the example did not have)


class _PackedGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.GRU(4, 4, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        return self.g(packed)[1]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_packed_sequence_is_named_as_the_cause(frontend):
    inputs = (torch.randn(2, 3, 4), torch.tensor([3, 2]))
    with pytest.raises(fxamp.TraceError) as err:
        fxamp.amp_rewrite(_PackedGRU(), inputs,
                          fxamp.RewriteConfig.make(frontend=frontend, target="cpu",
                                                   dtype=torch.bfloat16))
    text = str(err.value)
    assert "packed sequence" in text and "branch" not in text and "control flow" not in text


def test_an_rnns_own_flat_weight_cache_is_no_side_effect(caplog):
    model = nn.Sequential(nn.LSTM(4, 4, batch_first=True))
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        fxamp.amp_rewrite(model, (torch.randn(2, 3, 4),),
                          fxamp.RewriteConfig.make(target="cpu", dtype=torch.bfloat16))
    assert not [r for r in caplog.records if "changed its own state" in r.getMessage()]


def test_an_export_mismatch_where_the_rewritten_model_is_off_fp32_blames_the_plan():
    """The file and the rewritten model both differ from FP32 beyond the check's tolerance
    (and from each other): the plan's precision is the cause named, not the exporter (the
    message said 'the rewritten model agrees with FP32' without measuring it)."""
    from fxamp.export.overflow import PlanOverflowError
    from fxamp.export.verify import ExporterNumbersError, _compare, _mismatch

    class Off(torch.nn.Module):  # (the rewritten model: 5% of its scale off FP32)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1.05

    x = torch.linspace(-1, 1, 64).reshape(1, 64)
    want = [x.clone()]
    got = [(x * 1.10).numpy()]
    problem = _compare(got, want)
    assert problem is not None
    error = _mismatch(Off(), (x,), "the example input", got, problem, "dynamo", want)
    assert isinstance(error, PlanOverflowError) and not isinstance(error, ExporterNumbersError)
    assert "the rewritten model itself differs from FP32" in str(error)
    # (within tolerance of FP32, the rewritten model clears the plan: the exporter is named)
    close = _mismatch(torch.nn.Identity(), (x,), "the example input", got, problem,
                      "dynamo", want)
    assert isinstance(close, ExporterNumbersError)
