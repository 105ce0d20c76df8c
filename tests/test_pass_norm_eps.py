"""norm_eps pass: a norm whose eps the low dtype cannot hold runs its statistics in FP32."""
import pytest
import torch
import torch.nn as nn

import fxamp


class HandRMS(nn.Module):
    """Linear -> hand-written RMSNorm(eps=1e-12) -> Linear."""

    def __init__(self, eps=1e-12, form="rsqrt"):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.eps, self.form = eps, form
        nn.init.zeros_(self.a.bias)

    def forward(self, x):
        h = self.a(x)
        if self.form == "rsqrt":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        else:  # (x - mu) / sqrt(var + eps)
            mu = h.mean(-1, keepdim=True)
            var = (h - mu).pow(2).mean(-1, keepdim=True)
            h = (h - mu) / torch.sqrt(var + self.eps)
        return self.b(h)


def _rewrite(model, x, policy=None):
    return fxamp.amp_rewrite(model, (x,),
                             fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu",
                                                      policy=policy))


@pytest.mark.parametrize("form", ["rsqrt", "mean_var"])
def test_hand_written_norm_of_zero_rows_is_finite_and_matches_fp32(form):
    torch.manual_seed(0)
    model = HandRMS(form=form)
    x = torch.zeros(4, 8)
    ref = model(x)
    with torch.autocast("cpu", dtype=torch.float16):
        plain = model(x)
    half = model.half()(x.half()).float()
    model.float()
    out = _rewrite(model, x)(x)
    err = (out.float() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err < 1e-2 * ref.abs().max().item() + 1e-3, (
        f"fxamp: max err {err:.3g}; autocast finite={torch.isfinite(plain).all().item()}, "
        f".half() finite={torch.isfinite(half).all().item()}")
    assert not torch.isfinite(plain).all() and not torch.isfinite(half).all()
    plan = fxamp.plan_of(_rewrite(model, x))
    rules = {name: p.rule for name, p in plan.nodes.items()}
    assert [n for n, r in rules.items() if r == "norm_eps"], rules
    assert all(p.dtype == torch.float32 for p in plan.nodes.values() if p.rule == "norm_eps")
    assert plan.nodes["b"].rule == "autocast" and plan.nodes["b"].dtype == torch.float16


def test_eps_that_fp16_holds_is_left_alone():
    model = HandRMS(eps=1e-3)
    plan = fxamp.plan_of(_rewrite(model, torch.randn(4, 8)))
    assert "norm_eps" not in {p.rule for p in plan.nodes.values()}


def test_bf16_holds_tiny_eps():
    model = HandRMS(eps=1e-12)
    gm = fxamp.amp_rewrite(model, (torch.zeros(4, 8),),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    assert "norm_eps" not in {p.rule for p in fxamp.plan_of(gm).nodes.values()}
    assert torch.isfinite(gm(torch.zeros(4, 8))).all()


class EpsTensor(nn.Module):
    """Near miss: eps given as a tensor buffer — handled like a constant."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        nn.init.zeros_(self.a.bias)
        self.register_buffer("eps", torch.tensor(1e-12))

    def forward(self, x):
        h = self.a(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


def test_eps_as_a_tensor_is_handled():
    model = EpsTensor()
    x = torch.zeros(4, 8)
    out = _rewrite(model, x)(x)
    assert torch.isfinite(out).all()
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()


class NotANorm(nn.Module):
    """Near miss: a tiny constant added to something that is not a reduction."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + 1e-12


def test_tiny_constant_added_to_a_non_statistic_is_left_alone():
    plan = fxamp.plan_of(_rewrite(NotANorm(), torch.randn(2, 8)))
    assert plan.nodes["add"].rule == "autocast" and plan.nodes["add"].dtype == torch.float16


class InstNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)
        self.norm = nn.InstanceNorm2d(4, eps=1e-12)
        self.ln = nn.LayerNorm(4, eps=1e-12)

    def forward(self, x):
        h = self.norm(self.conv(x))
        return self.ln(h.mean((2, 3)))


def test_norm_modules_are_probed_and_fenced_only_where_the_kernel_loses_eps():
    model = InstNorm()
    x = torch.zeros(2, 2, 4, 4)
    gm = _rewrite(model, x)
    plan = fxamp.plan_of(gm)
    # InstanceNorm in fp16 gives NaN on a constant input with eps=1e-12 (probed)
    assert plan.nodes["norm"].rule == "norm_eps" and plan.nodes["norm"].dtype == torch.float32
    assert "probed" in plan.nodes["norm"].reason
    # LayerNorm's CPU kernel keeps eps (it accumulates in fp32): not fenced
    assert plan.nodes["ln"].rule == "autocast"
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()
    assert torch.isfinite(gm(x)).all()


# -- deployment plans: the eps is judged on the statistic's values seen -----------------
def _deploy(model, x, calibration=None):
    return fxamp.amp_rewrite(model, (x,),
                             fxamp.RewriteConfig.make(target="tensorrt",
                                                      calibration_data=calibration))


def _norm_eps_nodes(gm):
    return sorted(n for n, p in fxamp.plan_of(gm).nodes.items() if p.rule == "norm_eps")


@pytest.mark.parametrize("form", ["rsqrt", "mean_var"])
def test_a_deployment_plan_keeps_a_tiny_eps_norm_in_fp16_where_its_statistic_is_large(
        form, tmp_path):
    onnx = pytest.importorskip("onnx")
    from fxamp.export import export_onnx, run_true_fp16
    from fxamp.export.reference import relative_error

    torch.manual_seed(0)
    model, x = HandRMS(eps=1e-6, form=form).eval(), torch.randn(4, 8)
    assert _norm_eps_nodes(_rewrite(model, x))  # a training plan fences it (any input)
    gm = _deploy(model, x)
    assert _norm_eps_nodes(gm) == []  # the variance seen is ~1: the eps changes nothing
    assert all(p.dtype == torch.float16 for n, p in fxamp.plan_of(gm).nodes.items()
               if n in ("pow_1", "mean", "add", "rsqrt"))
    path = export_onnx(gm, (x,), str(tmp_path / "n.onnx"))  # right in true FP16
    proto = onnx.load(path)
    feed = {proto.graph.input[0].name: torch.randn(4, 8).numpy()}
    with torch.no_grad():
        want = model(torch.from_numpy(feed[proto.graph.input[0].name]))
    assert relative_error(run_true_fp16(proto, feed)[0], want) < 1e-2


def test_a_deployment_plan_fences_the_norm_where_the_statistic_seen_gets_small():
    torch.manual_seed(0)
    model = HandRMS(eps=1e-6)
    x = torch.randn(4, 8)
    assert _norm_eps_nodes(_deploy(model, x)) == []
    quiet = x.clone()
    quiet[1] = 1e-3  # a calibration batch with a row whose mean square is ~1e-6
    gm = _deploy(model, x, calibration=[(quiet,)])
    fenced = _norm_eps_nodes(gm)
    assert fenced and all(fxamp.plan_of(gm).nodes[n].dtype == torch.float32 for n in fenced)
    reason = fxamp.plan_of(gm).nodes[fenced[0]].reason
    seen = float(reason.split("gets down to ")[1].split()[0])
    assert "eps=1e-06" in reason and 0 < seen < 1e-4, reason


def test_eps_matters_where_it_changes_the_statistic_past_fp16s_rounding():
    from fxamp.passes.norm_eps import eps_matters

    fp16 = torch.float16
    assert not eps_matters(1e-6, 1.0, fp16)
    assert not eps_matters(1e-6, 2e-3, fp16)  # 1e-6 / 2e-3 = 5e-4: under fp16's eps
    assert eps_matters(1e-6, 5e-4, fp16)  # 2e-3 of the statistic
    assert eps_matters(1e-12, 1e-5, fp16)  # under fp16's smallest normal
    assert eps_matters(1e-12, 0.0, fp16)  # a constant row
