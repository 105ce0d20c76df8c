"""The dynamo exporter is given the rewritten graph with its weights cast already
(fxamp/export/weight_view.py): the ONNX file is the one the casting graph exports to, the
exporter traces no weight casts, and the model is never touched."""
import collections
import contextlib
import io

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.export import export_onnx
from fxamp.export.onnx_export import _export_dynamo
from fxamp.export.onnx_passes import run_onnx_steps
from fxamp.export.weight_view import FOLDED, fold_view_batchnorms, low_weights_view

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
from onnx import numpy_helper  # noqa: E402


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class Recurrent(nn.Module):
    """The LSTM is called with its weights swapped (the graph reads the module itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _model(kind):
    torch.manual_seed(0)
    if kind == "conv":
        model = ConvNet()
        with torch.no_grad():
            model.bn.running_var.uniform_(0.5, 2.0)
            model.bn.running_mean.uniform_(-1, 1)
        return model.eval(), (torch.randn(2, 3, 8, 8),)
    return Recurrent().eval(), (torch.randn(2, 5, 8),)


def _initializers(proto):
    return {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}


def _values(proto):
    """The file's initializers as (type, shape, bytes), whatever their names."""
    return sorted((i.data_type, tuple(i.dims), numpy_helper.to_array(i).tobytes())
                  for i in proto.graph.initializer)


@pytest.mark.parametrize("kind", ["conv", "lstm"])
def test_the_view_exports_the_file_the_casting_graph_exports(kind):
    """The same file once the ONNX steps ran: the same ops and initializer values (a
    BatchNorm folded in the view has its folded weight named after the Conv's weight, where
    the ONNX fold names it after the Conv node)."""
    model, x = _model(kind)
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    gm.eval()
    with contextlib.redirect_stdout(io.StringIO()):
        direct = torch.onnx.export(gm, x, dynamo=True, optimize=False).model_proto
    assert collections.Counter(n.op_type for n in direct.graph.node)["Cast"] > 2
    exported = _export_dynamo(gm, x, None)
    viewed, folds = exported[0], exported[4]
    assert folds == ([("conv", "bn")] if kind == "conv" else [])
    want = run_onnx_steps(direct, "dynamo").model
    got = run_onnx_steps(viewed, "dynamo").model
    assert _values(got) == _values(want)
    ops = collections.Counter(n.op_type for n in want.graph.node)
    assert collections.Counter(n.op_type for n in got.graph.node) == ops


def test_a_batchnorm_is_folded_in_the_view_from_the_fp32_values():
    """The view's Conv reads the folded weight and bias (FP32 sources, cast once); the
    BatchNorm is gone from the view and the model keeps its own."""
    model, x = _model("conv")
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    view, sources = low_weights_view(gm)
    assert fold_view_batchnorms(view, sources) == [("conv", "bn")]
    assert not any(n.op == "call_module" and n.target == "bn" for n in view.graph.nodes)
    assert sorted(sources) == ["conv.bias" + FOLDED, "conv.weight" + FOLDED, "head.bias",
                               "head.weight"]
    bn = model.bn
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    want = model.conv.weight * scale[:, None, None, None]
    assert torch.allclose(sources["conv.weight" + FOLDED], want.detach(), rtol=1e-6)
    assert isinstance(model.bn, nn.BatchNorm2d) and "bn" in dict(model.named_children())
    with torch.no_grad():  # the folded view computes what the casting graph does, in FP16
        assert torch.allclose(view(*x), gm(*x), atol=2e-2, rtol=2e-2)


def test_the_exporter_is_given_no_weight_cast():
    model, x = _model("conv")
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    view, sources = low_weights_view(gm)
    # (the BatchNorm stays a module call, which casts its own parameters)
    assert sorted(sources) == ["conv.weight", "head.bias", "head.weight"]
    assert all(sources[n] is model.get_parameter(n).detach() or
               torch.equal(sources[n], model.get_parameter(n)) for n in sources)
    attrs = [n for n in view.graph.nodes if n.op == "get_attr"]
    assert attrs and not any(u.op == "call_method" and u.target == "to"
                             for n in attrs for u in n.users)
    with torch.no_grad():
        assert torch.equal(view(*x), gm(*x))  # the same numbers, cast once ahead


@pytest.mark.parametrize("kind", ["conv", "lstm"])
def test_the_model_and_the_rewritten_module_are_untouched(tmp_path, kind):
    model, x = _model(kind)
    before = {n: (id(p), p.dtype) for n, p in model.named_parameters()}
    buffers = {n: (id(b), b.dtype) for n, b in model.named_buffers()}
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    export_onnx(gm, x, str(tmp_path / "m.onnx"))
    assert {n: (id(p), p.dtype) for n, p in model.named_parameters()} == before
    assert {n: (id(b), b.dtype) for n, b in model.named_buffers()} == buffers
    with torch.no_grad():
        assert gm(*x).dtype == torch.float32


def test_a_weight_read_in_two_dtypes_keeps_its_cast_in_the_graph():
    class TwoReads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.v = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return x @ self.w @ self.v, self.w.sum()  # FP16 matmuls, an FP32 sum of w

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    gm = fxamp.amp_rewrite(TwoReads().eval(), (x,),
                           fxamp.RewriteConfig.make(target="tensorrt", policy="fp32:sum_1"))
    view, sources = low_weights_view(gm)
    assert sorted(sources) == ["v"]  # w is read in FP32 too: its cast stays in the graph
    with torch.no_grad():
        for a, b in zip(view(x), gm(x)):
            assert torch.equal(a, b)
