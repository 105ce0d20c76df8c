"""ranges pass: calibration batches keep in FP32 the nodes whose values pass fp16's range."""
import pytest
import torch
import torch.nn as nn

import fxamp


@pytest.fixture(autouse=True)
def _seeded():
    """The models' random weights decide whether fp16 overflows: the same weights whatever
    test ran before (the global generator's state used to leak in from earlier files)."""
    torch.manual_seed(0)


class BigActivations(nn.Module):
    """A Linear whose outputs reach ~4e4 and a product that passes 65504 (T5-like)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.bn = nn.BatchNorm1d(16)
        with torch.no_grad():
            self.b.weight.mul_(10000)

    def forward(self, x):
        h = self.b(torch.relu(self.bn(self.a(x)))) * 3
        return self.c(h / 1000)


class Attention(nn.Module):
    """q @ k^T passes 65504 before the softmax."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.q.weight.mul_(60)
            self.k.weight.mul_(60)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(scores, -1) @ self.v(x)


def _batches(shape, n=4, scale=4.0):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g) * scale,) for _ in range(n)]


def _rel(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _check(model, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 4
    ref = model(x)
    plain = fxamp.amp_rewrite(model, (x,),
                              fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))(x)
    with torch.autocast("cpu", dtype=torch.float16):
        ac = model(x)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu",
                                                    calibration_data=_batches(shape)))
    out = gm(x)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2, (
        f"calibrated rel err {_rel(out, ref):.3g}; without calibration finite="
        f"{torch.isfinite(plain).all().item()}, autocast finite={torch.isfinite(ac).all().item()}")
    assert not torch.isfinite(plain).all() and not torch.isfinite(ac).all()
    return fxamp.plan_of(gm), x


def test_large_activations_are_kept_in_fp32_until_back_in_range():
    model = BigActivations().eval()
    plan, _ = _check(model, (8, 16))
    ranges = {n for n, p in plan.nodes.items() if p.rule == "ranges"}
    assert {"mul", "truediv"} <= ranges and "c" not in ranges and "a" not in ranges
    assert ("b" in ranges) == (plan.ranges["b"].max_abs > 65504 / 2)  # the margin
    assert "on calibration data" in plan.nodes["mul"].reason
    assert plan.nodes["c"].dtype == torch.float16  # back in range: low precision again


def test_attention_scores_that_overflow_before_the_softmax():
    plan, _ = _check(Attention().eval(), (2, 5, 8))
    assert plan.nodes["matmul"].rule == "ranges" and plan.nodes["matmul"].dtype == torch.float32
    assert plan.nodes["q"].dtype == torch.float16


def test_bf16_has_fp32_range_so_nothing_is_kept():
    model = BigActivations().eval()
    x = torch.randn(8, 16)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                    calibration_data=_batches((8, 16))))
    assert "ranges" not in {p.rule for p in fxamp.plan_of(gm).nodes.values()}


def test_statistics_live_in_the_plan_and_can_be_reused_without_data():
    model = BigActivations().train()
    stats_before = model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone()
    x = torch.randn(8, 16)
    plan = fxamp.plan_of(fxamp.amp_rewrite(
        model, (x,), fxamp.RewriteConfig.make(calibration_data=_batches((8, 16)))))
    assert torch.equal(model.bn.running_mean, stats_before[0])  # calibration changed nothing
    assert torch.equal(model.bn.num_batches_tracked, stats_before[1])
    text = plan.to_text()
    assert "@range mul max_abs=" in text
    again = fxamp.Plan.from_text(text)
    assert again == plan and again.to_text() == text
    reused = fxamp.plan_of(fxamp.amp_rewrite(model, (x,),
                                             fxamp.RewriteConfig.make(calibration_data=again)))
    assert reused == plan


def test_underflowing_values_are_reported(caplog):
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            with torch.no_grad():
                self.fc.weight.mul_(1e-7)
                self.fc.bias.zero_()

        def forward(self, x):
            return self.fc(x)

    with caplog.at_level("WARNING", logger="fxamp"):
        fxamp.amp_rewrite(Tiny(), (torch.randn(2, 8),),
                          fxamp.RewriteConfig.make(target="cpu",
                                                   calibration_data=_batches((2, 8), scale=1.0)))
    assert "fc: 100% of its non-zero values are below fp16's smallest normal" in caplog.text


# --------------------------------------------------------------------------- bad calibration
class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


X8 = torch.randn(2, 8)


def _calibrate(data, frontend="fx"):
    return fxamp.amp_rewrite(TwoLinear(), (X8,),
                             fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu",
                                                      frontend=frontend,
                                                      calibration_data=data))


@pytest.mark.parametrize("data,words", [
    (42, ("calibration_data=42 (type int) is not a collection of batches",
          "calibration_data=[(x1,), (x2,)]")),
    (torch.randn(4, 8), ("one tensor of shape (4, 8)", "calibration_data=[(x,)]")),
    ([], ("gave no batches", "at least one batch")),
    (iter([]), ("already used up", "a fresh iterator")),
])
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_calibration_data_that_is_no_batches_names_what_it_takes(data, words, frontend):
    with pytest.raises(fxamp.errors.CalibrationDataError) as err:
        _calibrate(data, frontend)
    text = str(err.value)
    assert "an iterable of batches" in text and "what to do" in text
    for word in words:
        assert word in text, text


def test_a_wrong_shape_batch_names_the_batch_and_the_node():
    with pytest.raises(fxamp.errors.CalibrationDataError) as err:
        _calibrate([(X8,), (torch.randn(3, 5),)])
    text = str(err.value)
    assert "calibration batch 2 ((3, 5)) fails in the FP32 model at node 'a'" in text
    assert "mat1 and mat2 shapes cannot be multiplied" in text
    assert "the example inputs are ((2, 8))" in text and "node: %a" in text


def test_a_wrong_shape_batch_on_the_export_front_end_names_the_shape_check():
    with pytest.raises(fxamp.errors.CalibrationDataError,
                       match=r"batch 2 \(\(3, 5\)\) does not fit the exported graph's inputs: "
                             r"torch.export's shape check says Guard failed: x.size\(\)\[1\] == 8"):
        _calibrate([(X8,), (torch.randn(3, 5),)], "export")


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_batch_with_more_inputs_than_the_model_takes_is_refused(frontend):
    # was: the second tensor silently dropped
    with pytest.raises(fxamp.errors.CalibrationDataError, match="batch 1 has 2 inputs"):
        _calibrate([(X8, X8)], frontend)
