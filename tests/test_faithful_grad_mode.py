"""Grad-mode regions inside forward are kept by both front ends, with autocast's gradients."""
import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import TraceError

BF16 = dict(target="cpu", dtype=torch.bfloat16)


class NoGrad(nn.Module):
    """Normalises by a statistic computed without gradient (the issue's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            m = self.lin2(h).abs().max()
        return h / m


class Nested(nn.Module):
    """enable_grad inside no_grad, and set_grad_enabled(False) as a context."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            s = self.b(h).sum()
            with torch.enable_grad():
                g = self.c(h)
        with torch.set_grad_enabled(False):
            t = self.b(h).mean()
        return g * s + h * t


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    @torch.no_grad()
    def scale(self, h):
        return self.b(h).abs().amax(-1, keepdim=True)

    def forward(self, x):
        h = self.a(x)
        return h / self.scale(h)


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _grads(model, run):
    out = run(_x())
    out.float().pow(2).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone()
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _check(model, frontend):
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(frontend=frontend, **BF16))

    def autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    ref, got = _grads(model, autocast), _grads(model, gm)
    for name, value in ref.items():
        if value is None:
            assert got[name] is None, f"{name} gets a gradient the model does not give it"
        else:
            torch.testing.assert_close(got[name], value, rtol=2e-2, atol=2e-2, msg=name)
    return gm


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("cls", [NoGrad, Nested, Decorated])
def test_grad_regions_give_autocasts_gradients(cls, frontend):
    torch.manual_seed(0)
    _check(cls(), frontend)


def test_no_grad_region_restores_an_outer_no_grad():
    torch.manual_seed(0)
    gm = fxamp.amp_rewrite(NoGrad(), (_x(),), fxamp.RewriteConfig.make(frontend="fx", **BF16))
    with torch.no_grad():
        out = gm(_x())
        assert not torch.is_grad_enabled()
    assert not out.requires_grad


class Inference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.inference_mode():
            s = x.abs().max()
        return self.lin(x) / s.clone()


class OwnAutocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        with torch.autocast("cpu", enabled=False):
            return h.float().exp()


@pytest.mark.parametrize("cls,word,frontend", [
    (Inference, "inference_mode", "fx"), (Inference, "inference_mode", "export"),
    (OwnAutocast, "torch.autocast region", "fx")])
def test_front_ends_refuse_regions_they_cannot_keep(cls, word, frontend):
    with pytest.raises(TraceError, match=word) as info:
        fxamp.amp_rewrite(cls(), (_x(),), fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    assert "test_faithful_grad_mode.py" in str(info.value)  # the user's line


def test_auto_runs_an_inference_mode_forward_eagerly():
    torch.manual_seed(0)
    model = Inference()
    x = _x().requires_grad_()
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    assert fxamp.plan_of(gm).header["frontend"] == "eager"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    out = gm(x)
    torch.testing.assert_close(out, ref.float())  # the rewritten model returns FP32
    (gx,) = torch.autograd.grad(out.float().sum(), x)
    (rx,) = torch.autograd.grad(ref.float().sum(), x)
    torch.testing.assert_close(gx, rx)


def test_auto_takes_a_models_own_autocast_region_with_export():
    torch.manual_seed(0)
    model = OwnAutocast()
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(_x())
    torch.testing.assert_close(gm(_x()), ref)
