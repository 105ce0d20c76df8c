"""loss pass: losses inside the model run in FP32; outputs are FP32 by default."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp


class ResidualMSE(nn.Module):
    """A hand-written MSE between two fp16 branches whose residuals are ~1e-4."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():  # outputs ~1e-2, where fp16 resolves a 1e-4 residual
            self.a.weight.mul_(0.01)
            self.a.bias.zero_()
            self.b.weight.copy_(self.a.weight)
            self.b.bias.fill_(1e-4)

    def forward(self, x):
        return ((self.a(x) - self.b(x)) ** 2).mean()


def test_hand_written_mse_of_small_residuals_does_not_underflow():
    model = ResidualMSE()
    x = torch.randn(16, 8)
    ref = model(x).item()
    with torch.autocast("cpu", dtype=torch.float16):
        plain = model(x).item()
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))
    out = gm(x).item()
    assert abs(out - ref) < 0.05 * ref, f"fxamp {out:.3g}, autocast {plain:.3g}, fp32 {ref:.3g}"
    assert plain == 0.0  # squares of ~1e-4 underflow fp16: the loss vanishes under autocast
    plan = fxamp.plan_of(gm)
    assert plan.nodes["pow_1"].rule == "loss" and plan.nodes["mean"].rule == "loss"
    assert plan.nodes["sub"].dtype == torch.float16  # the residual itself is representable


def test_cuda_target_already_runs_pow_in_fp32_so_no_loss_rule_is_needed():
    gm = fxamp.amp_rewrite(ResidualMSE(), (torch.randn(4, 8),),
                           fxamp.RewriteConfig.make(target="cuda"))
    plan = fxamp.plan_of(gm)
    assert plan.nodes["pow_1"].rule == "autocast" and plan.nodes["pow_1"].dtype == torch.float32


class WithBCE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, y):
        return F.binary_cross_entropy(torch.sigmoid(self.fc(x)), y)


def test_bce_runs_in_fp32_instead_of_being_refused():
    x, y = torch.randn(4, 8), torch.rand(4, 1)
    gm = fxamp.amp_rewrite(WithBCE(), (x, y), fxamp.RewriteConfig.make(target="cuda"))
    p = fxamp.plan_of(gm).nodes["binary_cross_entropy"]
    assert (p.rule, p.dtype, p.inputs) == ("loss", torch.float32, torch.float32)
    with_off = None
    try:
        fxamp.amp_rewrite(WithBCE(), (x, y),
                          fxamp.RewriteConfig.make(target="cuda", policy="numerics=off"))
    except fxamp.FxampError as err:
        with_off = str(err)
    assert with_off and "BCEWithLogits" in with_off


def test_bce_is_a_loss_in_the_export_front_end_too():
    """torch.export spells F.binary_cross_entropy ``aten.binary_cross_entropy.default``: the
    loss pass fences it there as well (the export front end used to refuse the model)."""
    x, y = torch.randn(4, 8), torch.rand(4, 1)
    plans = {fe: fxamp.plan_of(fxamp.amp_rewrite(
        WithBCE(), (x, y), fxamp.RewriteConfig.make(target="cuda", frontend=fe)))
        for fe in ("fx", "export")}
    fx_p = plans["fx"].nodes["binary_cross_entropy"]
    ex_p = plans["export"].nodes["binary_cross_entropy"]
    assert (fx_p.op, ex_p.op) == ("F.binary_cross_entropy", "aten.binary_cross_entropy")
    for p in (fx_p, ex_p):
        assert (p.rule, p.dtype, p.inputs) == ("loss", torch.float32, torch.float32)
        assert p.reason == f"{p.op} is a loss: its inputs are cast to fp32"


class GaussNLL(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)
        self.loss = nn.GaussianNLLLoss()

    def forward(self, x, y):
        h = self.fc(x)
        return self.loss(h[:, :1], y, h[:, 1:].exp())


def test_loss_modules_take_fp32_inputs_even_off_autocast_lists():
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    plan = fxamp.plan_of(fxamp.amp_rewrite(GaussNLL(), (x, y),
                                           fxamp.RewriteConfig.make(dtype=torch.bfloat16,
                                                                    target="cpu")))
    assert plan.nodes["loss"].rule == "loss" and plan.nodes["loss"].inputs == torch.float32


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x), x.argmax(-1)


def test_outputs_are_fp32_by_default_and_keep_with_output_keep():
    x = torch.randn(2, 8)
    logits, idx = fxamp.amp_rewrite(Logits(), (x,))(x)
    assert logits.dtype == torch.float32 and idx.dtype == torch.int64
    logits, _ = fxamp.amp_rewrite(Logits(), (x,), "output=keep")(x)
    assert logits.dtype == torch.float16


class LossInTuple(nn.Module):
    """Near miss: a loss returned inside a tuple is still a loss; a mean that is not of
    squared/abs/log terms is not."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.fc(x)
        return h.mean(), F.mse_loss(h, y)


def test_near_misses():
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    # placement=off: with it on, the mean moves to FP32 (rule "placement"), where it reuses
    # the FP32 cast of h made for the loss and saves the cast of its own output
    plan = fxamp.plan_of(fxamp.amp_rewrite(LossInTuple(), (x, y),
                                           fxamp.RewriteConfig.make(dtype=torch.float16,
                                                                    target="cpu",
                                                                    policy="placement=off")))
    assert plan.nodes["mean"].rule == "autocast" and plan.nodes["mean"].dtype == torch.float16
    assert plan.nodes["mse_loss"].inputs == torch.float32
