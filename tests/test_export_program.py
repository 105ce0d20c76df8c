"""One capture per export: a graph the torch.export front end made goes to the ONNX exporter
as the ExportedProgram it is, and gives the file a second torch.export of it gives."""
import contextlib
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxamp
from fxamp.export import export_onnx
from fxamp.export.program import exported_program
from fxamp.export.weight_view import low_weights_view


class Attention(nn.Module):
    """Tokens through a LayerNorm, one attention head with a causal mask filled with
    finfo.min, and an MLP: the ops of a small transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.qkv = nn.Linear(32, 96)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / 32 ** 0.5
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        h = x + scores.softmax(-1) @ v
        return h + self.mlp(h)


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _attention():
    torch.manual_seed(0)
    return Attention().eval(), (torch.randn(2, 12, 32),)


def _run(model_proto, x):
    sess = ort.InferenceSession(model_proto.SerializeToString(),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _meta(path):
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_export_front_end_graph_is_exported_as_planned_and_each_node_maps_to_the_plan(
        tmp_path):
    model, x = _attention()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt", frontend="export"))
    path = export_onnx(gm, x, str(tmp_path / "m.onnx"))
    assert _meta(path)["fxamp.capture"] == "planned graph"
    plan = fxamp.plan_of(gm)
    proto = onnx.load(path)
    mapped = [next((p.value for p in n.metadata_props if p.key == "fxamp.fx_node"), None)
              for n in proto.graph.node if n.op_type in ("MatMul", "Gemm", "Softmax",
                                                     "LayerNormalization")]
    assert mapped and all(name in plan.nodes for name in mapped), mapped
    with torch.no_grad():
        want = model(*x).numpy()
    got = _run(proto, *x)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_planned_program_gives_the_file_a_second_torch_export_gives():
    model, x = _attention()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt", frontend="export"))
    view, _ = low_weights_view(gm)
    program, names = exported_program(view, x)
    assert set(names.values()) <= {n.name for n in view.graph.nodes}
    with contextlib.redirect_stdout(io.StringIO()):
        planned = torch.onnx.export(program, x, dynamo=True, optimize=False,
                                    input_names=["x"]).model_proto
        captured = torch.onnx.export(view, x, dynamo=True, optimize=False).model_proto
    assert [n.op_type for n in planned.graph.node] == \
        [n.op_type for n in captured.graph.node]
    assert [i.name for i in planned.graph.input] == [i.name for i in captured.graph.input]
    assert np.array_equal(_run(planned, *x), _run(captured, *x))


def test_fx_front_end_graph_is_captured_again(tmp_path):
    torch.manual_seed(0)
    model, x = SmallCnn().eval(), (torch.randn(2, 3, 10, 10),)
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt", frontend="fx"))
    path = export_onnx(gm, x, str(tmp_path / "c.onnx"))
    assert _meta(path)["fxamp.capture"] == "captured again"


@pytest.mark.parametrize("graph", ["module calls", "python function"])
def test_graph_that_is_not_aten_gets_no_program(graph):
    torch.manual_seed(0)
    model, x = SmallCnn().eval(), (torch.randn(2, 3, 10, 10),)
    if graph == "module calls":
        gm = fx.symbolic_trace(model)
    else:  # an ATen graph with one call of a Python function added
        gm = torch.export.export(model, x, strict=False).module()
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            new = gm.graph.call_function(torch.nn.functional.relu, (out.args[0][0],))
        out.args = ((new,),)
        gm.recompile()
    assert exported_program(gm, x) is None
