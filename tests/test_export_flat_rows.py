"""A LayerNorm with eps 1e-12 over rows that are constant or nearly so (``3 + 1e-4 * x``):
FP16 rounds such a row to a constant, and the norm scales that rounding up to its output.
A deployment plan sees the rows on the example inputs and keeps the norm, and the node that
makes its input, in FP32. The file then agrees with PyTorch FP32 in onnxruntime and in true
FP16 (onnx.reference), judged on the mean over 8 batches of each batch's max error. A normal
LayerNorm stays FP16 and is exported as one fused LayerNormalization, as before."""
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.export import export_onnx, run_true_fp16
from fxamp.export.overflow import PlanOverflowError
from fxamp.export.reference import TRUE_FP16_RTOL, relative_error
from fxamp.passes.inner_values import row_spread
from fxamp.passes.norm_eps import FLAT_ERROR, rows_lost

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
# the model benchmarks/export_peers.py compares with the peers ("norm_flat")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _export_models import FlatRowsNorm, check_batches, norm_flat  # noqa: E402


def _plan(model, x, policy=None):
    return fxamp.plan_of(fxamp.amp_rewrite(model, x,
                                           fxamp.RewriteConfig.make(target="tensorrt",
                                                                    policy=policy)))


def test_a_layernorm_over_nearly_constant_rows_is_planned_fp32_with_its_input_saying_why():
    model, x, _ = norm_flat()
    plan = _plan(model, x)
    norm, add = plan.nodes["norm"], plan.nodes["add"]
    assert norm.dtype == torch.float32 and norm.rule == "norm_eps", plan.to_text()
    assert "rows seen are nearly constant" in norm.reason
    assert "eps=1e-12 does not damp it" in norm.reason
    assert add.dtype == torch.float32 and add.rule == "norm_eps"  # 3 + 1e-4 * up(x)
    assert "feeds norm" in add.reason
    assert plan.nodes["up"].dtype == torch.float16  # the rest stays fp16
    assert plan.nodes["head"].dtype == torch.float16
    off = _plan(model, x, policy="off:norm_eps")  # what the rule changes
    assert off.nodes["norm"].dtype == torch.float16 and off.nodes["add"].dtype == torch.float16


def _errors(path, model, batches):
    """Per batch, the max relative error of the file in onnxruntime (CPU) and in true FP16
    against the FP32 model."""
    proto = onnx.load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    in_ort, in_fp16 = [], []
    for (b,) in batches:
        with torch.no_grad():
            want = model(b)
        in_ort.append(relative_error(session.run(None, {name: b.numpy()})[0], want))
        in_fp16.append(relative_error(run_true_fp16(proto, {name: b.numpy()})[0], want))
    return in_ort, in_fp16


@pytest.mark.slow
def test_its_file_agrees_with_pytorch_in_onnxruntime_and_in_true_fp16_on_8_batches(tmp_path):
    model, x, check = norm_flat()
    path = export_onnx(fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt")), x,
                       str(tmp_path / "m.onnx"))
    in_ort, in_fp16 = _errors(path, model, check_batches("norm_flat", check, 8))
    assert statistics.fmean(in_ort) < 0.02 and max(in_ort) < TRUE_FP16_RTOL, in_ort
    assert statistics.fmean(in_fp16) < 0.02 and max(in_fp16) < TRUE_FP16_RTOL, in_fp16
    proto = onnx.load(path)
    (norm,) = [n for n in proto.graph.node if n.op_type == "LayerNormalization"]
    from fxamp.export.repairs import value_types

    assert value_types(proto)[norm.output[0]] == onnx.TensorProto.FLOAT


@pytest.mark.slow
def test_the_fp16_norm_over_those_rows_is_still_refused(tmp_path):
    """With the rule off, the file is as wrong as the peers' and fxamp refuses it."""
    model, x, _ = norm_flat()
    gm = fxamp.amp_rewrite(model, x,
                           fxamp.RewriteConfig.make(target="tensorrt", policy="off:norm_eps"))
    with pytest.raises(PlanOverflowError, match="fx node 'norm'"):
        export_onnx(gm, x, str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_a_normal_layernorm_stays_one_fused_fp16_layernormalization(tmp_path):
    torch.manual_seed(0)
    model, x = FlatRowsNorm(0.0, 1.0).eval(), (torch.randn(4, 16),)  # ordinary rows
    files = {}
    for policy in (None, "off:norm_eps"):
        gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt", policy=policy))
        norm = fxamp.plan_of(gm).nodes["norm"]
        assert norm.dtype == torch.float16 and norm.rule == "deploy"
        files[policy] = onnx.load(export_onnx(gm, x, str(tmp_path / f"{policy}.onnx")))
    ops = [n.op_type for n in files[None].graph.node]
    assert ops == [n.op_type for n in files["off:norm_eps"].graph.node]
    assert ops.count("LayerNormalization") == 1 and ops.count("Cast") == 2, ops
    from fxamp.export.repairs import value_types

    (norm,) = [n for n in files[None].graph.node if n.op_type == "LayerNormalization"]
    assert value_types(files[None])[norm.output[0]] == onnx.TensorProto.FLOAT16


def _spread(rows, eps=1e-12):
    """row_spread of a LayerNorm module's node on ``rows``."""
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.LayerNorm(rows.shape[-1], eps=eps)))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    return row_spread(node, gm, (rows,), {})


def test_row_spread_finds_the_flattest_row_and_when_fp16_loses_it():
    torch.manual_seed(0)
    normal = torch.randn(3, 64)
    ratio, _, _, _ = _spread(normal)
    assert ratio > 0.25 and not rows_lost(ratio, torch.float16)
    flat = torch.cat([normal, 3 + 1e-4 * torch.randn(1, 64)])
    ratio, spread, size, eps = _spread(flat)  # the flat row, not the normal ones
    assert size == pytest.approx(3, rel=1e-3) and spread < 1e-3 and eps == 1e-12
    assert rows_lost(ratio, torch.float16)
    assert torch.finfo(torch.float16).eps / 2 / ratio > FLAT_ERROR
    constant = torch.full((2, 64), 3.0)  # exactly constant: spread is sqrt(eps)
    ratio, spread, _, _ = _spread(constant)
    assert spread == pytest.approx(1e-6) and rows_lost(ratio, torch.float16)


def test_row_spread_leaves_wide_rows_and_large_activations_alone():
    torch.manual_seed(0)
    wide = 3 + 0.2 * torch.randn(4, 64)  # fp16 keeps the spread (2^-11 * 3 << 0.2)
    assert not rows_lost(_spread(wide)[0], torch.float16)
    outlier = torch.randn(4, 64)
    outlier[:, 5] = 1000.0  # one massive activation per row: it is the spread
    assert not rows_lost(_spread(outlier)[0], torch.float16)
    assert _spread(torch.zeros(2, 64)) is None  # all-zero rows: nothing to judge
    np.testing.assert_allclose(_spread(torch.ones(2, 64), eps=1e-5)[0], np.sqrt(1e-5),
                               rtol=1e-6)


class ThroughMovers(nn.Module):
    """The flat rows reach the norm through a dropout and a view."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(32, eps=1e-12)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(3 + 1e-4 * self.up(x)).view(x.shape[0], 2, 32)
        return self.head(self.norm(h))


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_the_rows_stay_fp32_back_through_dropout_and_view_to_the_add_that_makes_them(
        tmp_path, frontend):
    torch.manual_seed(0)
    model, x = ThroughMovers().eval(), (torch.randn(4, 16),)
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt", frontend=frontend))
    plan = fxamp.plan_of(gm)
    names = {"fx": ("add", "drop", "view", "norm"), "export": ("add", "dropout", "view",
                                                               "layer_norm")}[frontend]
    for name in names:
        line = plan.nodes[name]
        assert line.dtype == torch.float32 and line.rule == "norm_eps", plan.to_text()
    assert plan.nodes["mul"].dtype == torch.float16  # 1e-4 * up(x) keeps its digits in fp16
    path = export_onnx(gm, x, str(tmp_path / "m.onnx"))  # checked in true FP16 on export
    in_ort, in_fp16 = _errors(path, model, [(torch.randn(4, 16),) for _ in range(8)])
    assert max(in_ort) < TRUE_FP16_RTOL and max(in_fp16) < TRUE_FP16_RTOL
