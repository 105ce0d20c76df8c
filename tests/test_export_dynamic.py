"""Dynamic axes in the FP16 ONNX file (``export_onnx(..., dynamic_shapes=...)``, ``fxamp
export --dynamic``): a tiny BERT and GPT-2 rewritten with a deployment plan (traced static)
are exported with dynamic batch and sequence axes, run in onnxruntime at several shapes and
compared with FP32; the export's checks run at a second shape; an axis the model's code
fixes is refused with a clear error."""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import fxamp
from fxamp.cli import main

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from fxamp.export import DynamicShapesError, export_onnx, precision_report  # noqa: E402

pytestmark = pytest.mark.slow
POLICY = "compute=fp16,target=tensorrt"
SHAPES = [(2, 16), (1, 8), (4, 32), (3, 37)]


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=64)
    return transformers.BertModel(cfg).eval()


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=500, n_embd=32, n_layer=1, n_head=2,
                                  n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _dims(path: str) -> dict:
    model = onnx.load(path)
    return {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input}


def _meta(path: str) -> dict:
    return {p.key: p.value for p in onnx.load(path).metadata_props}


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((torch.as_tensor(got).float() - want.float()).abs().max())


@pytest.mark.parametrize("make, vocab", [(_bert, 100), (_gpt2, 500)], ids=["bert", "gpt2"])
def test_a_static_deployment_plan_exports_with_dynamic_batch_and_sequence(tmp_path, make,
                                                                          vocab):
    torch.manual_seed(0)
    model = make()
    ids = torch.randint(0, vocab, (2, 16))
    gm = fxamp.amp_rewrite(model, (ids,), POLICY)  # (traced for the example's sizes)
    path = export_onnx(gm, (ids,), str(tmp_path / "m.onnx"), dynamic_shapes="auto")
    dims = _dims(path)["input_ids"]
    assert all(isinstance(d, str) for d in dims), dims
    meta = _meta(path)
    assert meta["fxamp.dynamic_axes"] == "input_ids:0,1"
    assert meta["fxamp.checked_shapes"] == "2x16; 3x9"  # the checks ran at a second shape
    # the reference: the same plan in PyTorch, traced with the same dynamic axes
    shapes = {"input_ids": {0: Dim.AUTO, 1: Dim.AUTO}}
    torch_fp16 = fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(
        POLICY, frontend="export", dynamic_shapes=shapes))
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for shape in SHAPES:
        x = torch.randint(0, vocab, shape)
        with torch.no_grad():
            want = model(x)[0]
            ref = _max_error(torch_fp16(x)[0], want)
        got = _max_error(session.run(None, {"input_ids": x.numpy()})[0], want)
        assert got <= 1.1 * ref + 1e-4, (shape, got, ref)


def test_a_dynamic_spec_by_name_and_a_graph_already_dynamic(tmp_path):
    """A graph the export front end traced with dynamic axes is exported as it is (no
    second rewrite); the spec keyed by the forward's names means what torch.export says."""
    torch.manual_seed(0)
    model = _bert()
    ids = torch.randint(0, 100, (2, 16))
    shapes = {"input_ids": {0: Dim.AUTO, 1: Dim.AUTO}}
    gm = fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(
        POLICY, frontend="export", dynamic_shapes=shapes))
    path = export_onnx(gm, (ids,), str(tmp_path / "m.onnx"),
                       dynamic_shapes={"input_ids": {0: Dim.AUTO}})
    dims = _dims(path)["input_ids"]
    assert isinstance(dims[0], str) and dims[1] == 16, dims
    assert _meta(path)["fxamp.checked_shapes"] == "2x16; 3x16"


def test_without_dynamic_shapes_the_file_is_static_as_before(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 16))
    gm = fxamp.amp_rewrite(_bert(), (ids,), POLICY)
    path = export_onnx(gm, (ids,), str(tmp_path / "m.onnx"))
    assert _dims(path)["input_ids"] == [2, 16]
    assert "fxamp.dynamic_axes" not in _meta(path)


class FixedBatch(nn.Module):
    """Code that needs the example's batch: a reshape to a literal 2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).reshape(2, 2, 2)


def test_an_axis_the_models_code_fixes_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    gm = fxamp.amp_rewrite(FixedBatch().eval(), (x,), POLICY)
    out = tmp_path / "m.onnx"
    with pytest.raises(DynamicShapesError) as info:
        export_onnx(gm, (x,), str(out), dynamic_shapes="auto")
    message = str(info.value)
    assert "3x8" in message and "reshape" in message and "what to do" in message
    assert not out.exists()
    assert isinstance(info.value, fxamp.FxampError)


def test_a_spec_naming_no_input_is_refused(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    gm = fxamp.amp_rewrite(nn.Sequential(nn.Linear(8, 4)).eval(), (x,), POLICY)
    with pytest.raises(DynamicShapesError, match="'input_ids'"):
        export_onnx(gm, (x,), str(tmp_path / "m.onnx"),
                    dynamic_shapes={"input_ids": {0: Dim.AUTO}})


FACTORY = """
    import torch
    import transformers

    def bert():
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=64)
        model = transformers.BertModel(cfg).eval()
        return model, (torch.randint(0, 100, (2, 16)),)
"""


def test_cli_export_dynamic_writes_dynamic_axes_and_reports_two_shapes(tmp_path, monkeypatch,
                                                                       capsys):
    (tmp_path / "tiny_models.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["export", "tiny_models.py:bert", "--target", "tensorrt", "-o", "m.onnx",
                 "--report", "r.md", "--dynamic"])
    assert code == 0, capsys.readouterr().err
    path = str(tmp_path / "m.onnx")
    assert all(isinstance(d, str) for d in _dims(path)["input_ids"])
    assert _meta(path)["fxamp.capture"] == "captured again"
    report = (tmp_path / "r.md").read_text()
    assert " at 3x9 |" in report  # the numerics at a second shape
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for shape in SHAPES:
        out = session.run(None, {"input_ids": torch.randint(0, 100, shape).numpy()})[0]
        assert out.shape == (*shape, 32)


def test_the_report_of_a_dynamic_file_measures_another_shape(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8)
    gm = fxamp.amp_rewrite(model, (x,), POLICY)
    path = export_onnx(gm, (x,), str(tmp_path / "m.onnx"), dynamic_shapes="auto")
    rows = precision_report(path, backend="onnxruntime", inputs=(x,), reference=model).numerics
    assert [r["output"].partition(" at ")[2] for r in rows] == ["", "4x8"]
    assert all(r["ok"] for r in rows)
