"""The exported deployment file: BatchNorm folded, Casts only at real boundaries, FP32 I/O."""
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
from onnx import TensorProto, helper

import fxamp
from fxamp.export import export_onnx
from fxamp.export.cast_pairs import simplify_casts

from test_deploy_target import Block


class BnCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # c2 has more than 8192 weights: the exporter's own folding (onnxscript's constant
        # limit) leaves its FP16 cast, and its BatchNorm, in the graph
        self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 32, 3, bias=False), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)))
        return self.fc(h.mean((2, 3)))


def _bn_cnn():
    torch.manual_seed(0)
    model = BnCnn()
    with torch.no_grad():  # statistics that are not the identity
        for bn in (model.b1, model.b2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return model.eval(), (torch.randn(2, 3, 12, 12),)


def _ops(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def _run(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


@pytest.mark.parametrize("target", ["tensorrt", "cuda"])
def test_batchnorm_folds_into_the_conv_without_changing_the_plan(tmp_path, target):
    model, x = _bn_cnn()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target=target))
    plan = fxamp.plan_of(gm).to_text()
    path = export_onnx(gm, x, str(tmp_path / "m.onnx"))
    ops = _ops(path)
    assert "BatchNormalization" not in ops and ops.count("Conv") == 2
    assert fxamp.plan_of(gm).to_text() == plan  # the plan's decisions are untouched
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert meta["fxamp.plan"] == plan
    want = model(*x).detach().numpy()
    assert np.abs(_run(path, x[0]) - want).max() < 2e-2


def test_a_tensorrt_export_casts_only_at_the_graph_inputs_and_outputs(tmp_path):
    torch.manual_seed(0)
    model, x = Block().eval(), (torch.randn(2, 5, 16),)
    path = export_onnx(fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt")), x,
                       str(tmp_path / "b.onnx"))
    proto = onnx.load(path)
    assert _ops(path).count("Cast") == 2
    assert proto.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert proto.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT


def _cast(src, dst, to):
    return helper.make_node("Cast", [src], [dst], to=to)


def test_cancelling_and_repeated_casts_go_lossy_pairs_stay():
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    nodes = [_cast("x", "h", f16),                      # the input boundary: kept
             _cast("h", "up", f32), _cast("up", "down", f16),  # fp16 -> fp32 -> fp16: exact
             _cast("h", "same", f16),                   # a cast to its own type
             _cast("h", "up2", f32),                    # a second cast of h to fp32
             helper.make_node("Add", ["down", "same"], ["s"]),
             _cast("s", "s32", f32),
             helper.make_node("Add", ["up", "up2"], ["t"]),
             _cast("t", "t16", f16), _cast("t16", "t32", f32),  # fp32 -> fp16 -> fp32: rounds
             helper.make_node("Add", ["s32", "t32"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f32, [4])],
                              [helper.make_tensor_value_info("y", f32, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([1.0001, 3.3, -2.7, 65000.0], np.float32)

    def run(m):
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, {"x": x})[0]
    before = run(model)
    assert simplify_casts(model) == 3
    casts = [(n.input[0], n.output[0]) for n in model.graph.node if n.op_type == "Cast"]
    assert ("t16", "t32") in casts and ("t", "t16") in casts  # the rounding pair stays
    assert ("up", "down") not in casts and ("h", "same") not in casts
    onnx.checker.check_model(model)
    np.testing.assert_array_equal(run(model), before)


class Large(nn.Module):
    """Activations near 1e5 before a LayerNorm: past FP16's max in a training plan."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.norm(self.up(x) * 5e4))


def test_an_overflowing_plan_is_named_with_its_range_not_blamed_on_tracing(tmp_path):
    from fxamp.export import PlanOverflowError

    torch.manual_seed(0)
    model, x = Large().eval(), (torch.randn(4, 8),)
    gm = fxamp.amp_rewrite(model, x)  # target cuda: no ranges without calibration data
    with pytest.raises(PlanOverflowError) as info:
        export_onnx(gm, x, str(tmp_path / "m.onnx"))
    text = str(info.value)
    with torch.no_grad():
        peak = float((model.up(x[0]) * 5e4).abs().max())
    assert "overflows at node 'mul'" in text
    got = float(re.search(r"reaches ([0-9.e+]+) in FP32", text).group(1))
    assert abs(got - peak) < 0.01 * peak  # (from its fp16 inputs: their rounding only)
    assert "calibration_data" in text and "fp32:mul" in text and "target='tensorrt'" in text
    assert "tracing" not in text and "branch" not in text
    assert not (tmp_path / "m.onnx").exists()
    # the fixes it names work: the deployment target, or calibration data
    export_onnx(fxamp.amp_rewrite(
        model, x, fxamp.RewriteConfig.make(target="tensorrt")), x, str(tmp_path / "t.onnx"))
    export_onnx(fxamp.amp_rewrite(
        model, x, fxamp.RewriteConfig.make(calibration_data=[x])), x, str(tmp_path / "c.onnx"))


def test_true_fp16_check_names_the_onnx_node_that_overflows():
    from fxamp.export import PlanOverflowError
    from fxamp.export.verify import check_true_fp16

    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    scale = helper.make_tensor("k", f16, [], [1000.0])
    nodes = [_cast("x", "h", f16), helper.make_node("Mul", ["h", "k"], ["big"], name="mul_k"),
             helper.make_node("Div", ["big", "k"], ["back"]), _cast("back", "y", f32)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f32, [2])],
                              [helper.make_tensor_value_info("y", f32, [2])], [scale])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    class Same(nn.Module):  # what the file computes, in FP32: finite
        def forward(self, x):
            return x * 1000.0 / 1000.0
    x = (torch.tensor([100.0, 1.0]),)
    with pytest.raises(PlanOverflowError, match="ONNX node 'mul_k' \\(Mul"):
        check_true_fp16(proto, Same(), x, ["x"])
    check_true_fp16(proto, Same(), (torch.tensor([1.0, 2.0]),), ["x"])  # in range: passes


def test_modelopt_autocast_gives_nan_in_true_fp16_where_the_deployment_plan_is_right(tmp_path):
    """The peer's file on the numerics trap (needs nvidia-modelopt[onnx]; skipped without)."""
    pytest.importorskip("modelopt.onnx.autocast")
    from modelopt.onnx.autocast import convert_to_mixed_precision

    from fxamp.export import run_true_fp16

    class Trap(nn.Module):
        def forward(self, x):
            z = x - x.mean(-1, keepdim=True)
            z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-12)
            return torch.exp(z * 6) / torch.exp(z * 6).sum(-1, keepdim=True)
    x = torch.randn(3, 16)
    x[0] = 0.5  # a constant row
    model, fp32 = Trap().eval(), str(tmp_path / "fp32.onnx")
    torch.onnx.export(model, (x,), fp32, dynamo=True)
    peer = convert_to_mixed_precision(onnx_path=fp32, low_precision_type="fp16",
                                      keep_io_types=True)
    ours = onnx.load(export_onnx(fxamp.amp_rewrite(
        model, (x,), fxamp.RewriteConfig.make(target="tensorrt")), (x,),
                                 str(tmp_path / "ours.onnx")))
    name = ours.graph.input[0].name
    assert not np.isfinite(run_true_fp16(peer, {peer.graph.input[0].name: x.numpy()})[0]).all()
    got = run_true_fp16(ours, {name: x.numpy()})[0]
    assert np.abs(got - model(x).numpy()).max() < 1e-2


class EpsSoftmaxSum(nn.Module):
    """A hand-written norm with ``+ 1e-12``, a hand-written softmax and a sum past FP16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)

    def forward(self, x):
        z = x - x.mean(-1, keepdim=True)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-12)
        h = self.proj(z) * 4.0
        p = torch.exp(h) / torch.exp(h).sum(-1, keepdim=True)
        return p, (h * 1e3).sum(-1)  # the sum passes 65504


@pytest.mark.parametrize("target", ["cuda", "tensorrt"])
def test_what_the_cuda_plan_exports_the_tensorrt_plan_exports(tmp_path, target):
    from fxamp.export import run_true_fp16
    from fxamp.export.reference import relative_error

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    x[0] = 0.5  # a constant row: its centred values are 0
    model = EpsSoftmaxSum().eval()
    path = export_onnx(fxamp.amp_rewrite(
        model, (x,), fxamp.RewriteConfig.make(target=target)), (x,),
                       str(tmp_path / f"{target}.onnx"))
    proto = onnx.load(path)
    y = torch.randn(4, 16)
    y[2] = -1.0
    got = run_true_fp16(proto, {proto.graph.input[0].name: y.numpy()})
    with torch.no_grad():
        want = model(y)
    assert all(relative_error(g, w) < 1e-2 for g, w in zip(got, want))
