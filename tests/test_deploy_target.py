"""target="tensorrt": a deployment plan, all FP16 except where a number forces FP32."""
import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import Policy
from fxamp.passes.deploy import DEEP_REDUCTION


class Block(nn.Module):
    """A transformer-like block: autocast's training lists put LayerNorm, softmax in FP32."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.qk = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.norm(x)
        scores = torch.softmax(self.qk(h) @ h.transpose(-1, -2), -1)
        return self.out(torch.nn.functional.gelu(scores @ h))


class Large(nn.Module):
    def __init__(self, scale: float = 5e4) -> None:
        super().__init__()
        self.up, self.norm, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        self.scale = scale

    def forward(self, x):
        return self.head(self.norm(self.up(x) * self.scale))


def _computing(plan):
    return {k: p for k, p in plan.nodes.items() if p.op not in ("placeholder", "get_attr")}


def test_tensorrt_plan_runs_autocasts_fp32_list_ops_in_fp16():
    torch.manual_seed(0)
    model, x = Block().eval(), (torch.randn(2, 5, 16),)
    cuda = fxamp.plan_of(fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="cuda")))
    trt = fxamp.plan_of(fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt")))
    assert cuda.nodes["norm"].dtype == torch.float32  # training: autocast's fp32 list
    assert cuda.nodes["softmax"].dtype == torch.float32
    nodes = _computing(trt)
    assert all(p.dtype == torch.float16 for p in nodes.values()), trt.to_text()
    assert all(p.rule == "deploy" for p in nodes.values())
    assert "policy: compute=fp16,target=tensorrt" in trt.to_text()
    assert fxamp.Plan.from_text(trt.to_text()).to_text() == trt.to_text()


def test_a_range_past_fp16_on_the_example_inputs_keeps_fp32_naming_the_number():
    torch.manual_seed(0)
    model, x = Large().eval(), (torch.randn(4, 8),)
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    plan = fxamp.plan_of(gm)
    with torch.no_grad():
        peak = float((model.up(x[0]) * 5e4).abs().max())
    for name in ("mul", "norm"):
        p = plan.nodes[name]
        assert p.dtype == torch.float32 and p.rule == "ranges"
        assert f"{peak:.3g}" in p.reason and "example inputs" in p.reason, p.reason
    assert plan.nodes["up"].dtype == torch.float16 and plan.nodes["head"].dtype == torch.float16
    assert torch.isfinite(gm(*x)).all()
    assert torch.allclose(gm(*x).float(), model(*x), atol=5e-2, rtol=5e-2)


def test_calibration_data_adds_ranges_the_example_inputs_do_not_reach():
    torch.manual_seed(0)
    model, x = Large(scale=100.0).eval(), (torch.randn(4, 8),)
    assert fxamp.plan_of(fxamp.amp_rewrite(
        model, x, fxamp.RewriteConfig.make(target="tensorrt"))).nodes[
        "mul"].dtype == torch.float16
    big = [(torch.randn(4, 8) * 1e3,)]
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, x,
                                           fxamp.RewriteConfig.make(target="tensorrt",
                                                                    calibration_data=big)))
    assert plan.nodes["mul"].dtype == torch.float32
    assert "the example inputs and calibration data" in plan.nodes["mul"].reason


class Summer(nn.Module):
    def forward(self, x):
        return x.sum(-1) + x.mean(0)[:1]


def test_a_deep_reduction_stays_fp32_a_shallow_one_goes_fp16():
    x = (torch.rand(4, DEEP_REDUCTION * 2),)
    plan = fxamp.plan_of(fxamp.amp_rewrite(
        Summer(), x, fxamp.RewriteConfig.make(target="tensorrt")))
    assert plan.nodes["sum_1"].dtype == torch.float32
    assert f"reduces {DEEP_REDUCTION * 2} values" in plan.nodes["sum_1"].reason
    assert plan.nodes["mean"].dtype == torch.float16  # 4 values per output


def test_a_weight_past_fp16s_range_keeps_its_layer_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    with torch.no_grad():
        model[0].bias.zero_()
        model[1].weight[0, 0] = 2e5
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, (torch.randn(2, 4) * 1e-3,),
                                           fxamp.RewriteConfig.make(target="tensorrt")))
    assert plan.nodes["_0"].dtype == torch.float16
    assert plan.nodes["_1"].dtype == torch.float32
    assert "a weight reaches 2e+05" in plan.nodes["_1"].reason


def test_engine_fp32_ops_are_the_tensorrt_tables_ops_without_fp16():
    from fxamp.export.tensorrt_ops import TENSORRT_TYPES
    from fxamp.oplists import ENGINE_FP32_OPS

    no_fp16 = {op for op, types in TENSORRT_TYPES.items()
               if types and "FP32" in types.split() and "FP16" not in types.split()}
    assert set(ENGINE_FP32_OPS["tensorrt"].values()) == no_fp16


def test_policy_grammar_and_overrides_work_for_tensorrt():
    pol = Policy.parse("target=tensorrt,fp32:head")
    assert pol.target == "tensorrt" and str(pol) == "compute=fp16,target=tensorrt,fp32:head"
    torch.manual_seed(0)
    plan = fxamp.plan_of(fxamp.amp_rewrite(Large(scale=1.0).eval(), (torch.randn(2, 8),), pol))
    assert plan.nodes["head"].dtype == torch.float32 and plan.nodes["head"].rule == "user"
    assert plan.nodes["up"].dtype == torch.float16


@pytest.mark.slow
def test_cli_export_target_tensorrt_writes_the_deployment_plan(tmp_path, monkeypatch, capsys):
    import onnx

    from fxamp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["export", "fxamp.demo:small_cnn", "--target", "tensorrt", "-o", "m.onnx"]) == 0
    meta = {p.key: p.value for p in onnx.load("m.onnx").metadata_props}
    assert "policy: compute=fp16,target=tensorrt" in meta["fxamp.plan"]
    assert " deploy " in meta["fxamp.plan"]


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_deployment_plan_is_the_eval_mode_graph_and_a_train_mode_model_is_told(
        frontend, caplog):
    import logging

    torch.manual_seed(0)
    model, x = DropoutNet(), torch.randn(16, 8)
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        gm = fxamp.amp_rewrite(model, (x,),
                               fxamp.RewriteConfig.make(target="tensorrt", frontend=frontend))
    assert any("traced in eval mode once" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        want = model.eval()(x)
        got = gm.eval()(x)
    assert (got - want).abs().max() < 1e-2 * want.abs().max()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        fxamp.amp_rewrite(model.eval(), (x,),
                          fxamp.RewriteConfig.make(target="tensorrt", frontend=frontend))
    assert not any("traced in eval mode" in r.getMessage() for r in caplog.records)
