"""A deployment plan judges the numbers a node computes inside (a norm's sum of squares),
and the exported file is checked as a file: onnx.reference in its declared types against
the FP32 model, never PyTorch running FP16 ops on the CPU."""
import sys
from pathlib import Path

import pytest
import torch

import fxamp
from fxamp.export import export_onnx, precision_report, run_true_fp16
from fxamp.export.overflow import PlanOverflowError
from fxamp.export.reference import TRUE_FP16_RTOL, fp32_reference, relative_error

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
# the models benchmarks/export_peers.py compares with the peers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _export_models import LargeEmbeddingNorm, Recurrent  # noqa: E402


def _large():
    torch.manual_seed(0)
    return LargeEmbeddingNorm(scale=80.0).eval(), (torch.randint(0, 100, (2, 16)),)


def _feed(path, inputs):
    proto = onnx.load(path)
    inits = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    return proto, {n: t.numpy() for n, t in zip(names, inputs)}


def test_a_norm_whose_sum_of_squares_passes_fp16_is_planned_fp32_naming_the_value():
    model, x = _large()
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt")))
    with torch.no_grad():
        h = ((model.tok(x[0]) + model.pos) * model.scale).double()
        want = float((h - h.mean(-1, keepdim=True)).pow(2).sum(-1).max())
    assert max(plan.ranges[n].max_abs for n in ("add", "mul")) < 65504 / 128
    norm = plan.nodes["norm"]
    assert norm.dtype == torch.float32 and norm.rule == "ranges", plan.to_text()
    assert f"its variance's sum of squares reaches {want:.3g}" in norm.reason
    assert "past fp16's max 65504" in norm.reason
    assert plan.nodes["head"].dtype == torch.float16  # its input is back in range


def test_its_exported_file_is_right_in_true_fp16(tmp_path):
    model, x = _large()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    path = export_onnx(gm, x, str(tmp_path / "m.onnx"))
    proto, feed = _feed(path, x)
    with torch.no_grad():
        want = model(*x)
    assert relative_error(run_true_fp16(proto, feed)[0], want) < 5e-3
    meta = {p.key: p.value for p in proto.metadata_props}
    assert float(meta["fxamp.true_fp16_error"]) < 5e-3


def test_a_hand_forced_fp16_norm_is_refused_by_the_true_fp16_check(tmp_path):
    model, x = _large()
    gm = fxamp.amp_rewrite(model, x,
                           fxamp.RewriteConfig.make(target="tensorrt", policy="fp16:norm"))
    assert fxamp.plan_of(gm).nodes["norm"].dtype == torch.float16
    with pytest.raises(PlanOverflowError) as err:
        export_onnx(gm, x, str(tmp_path / "m.onnx"))
    text = str(err.value)
    assert "wrong in true FP16" in text and "fx node 'norm'" in text
    assert "LayerNormalization" in text and f"tolerance {TRUE_FP16_RTOL:g}" in text
    assert "'fp32:norm'" in text
    assert not (tmp_path / "m.onnx").exists()


def test_the_report_shows_the_true_fp16_result_next_to_the_backends(tmp_path):
    model, x = _large()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    path = export_onnx(gm, x, str(tmp_path / "m.onnx"))
    report = precision_report(path, fxamp.plan_of(gm), backend="onnxruntime", inputs=x,
                              reference=model)
    row = report.numerics[0]
    assert row["ok"] and row["true_fp16_ok"]
    assert row["true_fp16_max_abs"] <= TRUE_FP16_RTOL * row["ref_max"]
    assert "true FP16 (onnx.reference): max abs error" in report.summary()
    assert "| true FP16 max abs error | true FP16 ok |" in report.to_markdown()


def test_the_fp32_reference_of_a_rewritten_model_is_the_fp32_model_bit_for_bit():
    model, x = _large()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    with torch.no_grad():
        want = model(*x)
    got = fp32_reference(gm)(*x)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_an_lstm_gru_classifier_exports_its_recurrent_ops_in_fp16(tmp_path, frontend):
    from fxamp.export.repairs import value_types

    torch.manual_seed(0)
    model, x = Recurrent().eval(), (torch.randn(2, 10, 16),)
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt", frontend=frontend))
    path = export_onnx(gm, x, str(tmp_path / "rnn.onnx"))
    proto, feed = _feed(path, x)
    types = value_types(proto)
    rnn = [n for n in proto.graph.node if n.op_type in ("LSTM", "GRU")]
    assert sorted(n.op_type for n in rnn) == ["GRU", "LSTM", "LSTM"]
    assert all(types.get(n.output[0]) == 10 for n in rnn)  # FP16
    with torch.no_grad():
        want = model(*x)
    assert relative_error(run_true_fp16(proto, feed)[0], want) < 1e-2


class _Det(torch.nn.Module):
    """A projection and a determinant: the file computes ``Det`` in FP16, which
    onnx.reference cannot run (numpy's linalg takes no float16)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.linalg.det(self.lin(x).reshape(8, 8))


def test_a_file_the_reference_evaluator_cannot_run_says_so_in_its_metadata(tmp_path, caplog):
    """A warning, the file's metadata and the report say it was not checked, and why: never
    a bare '-'. (If onnx.reference learns FP16 Det, this needs another unrunnable op.)"""
    torch.manual_seed(0)
    model, x = _Det().eval(), (torch.randn(8, 8),)
    gm = fxamp.amp_rewrite(model, x, "compute=fp16,target=tensorrt")
    path = tmp_path / "det.onnx"
    export_onnx(gm, x, str(path))
    proto = onnx.load(str(path))
    assert any(n.op_type == "Det" for n in proto.graph.node)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["fxamp.true_fp16_error"] == "-"
    assert meta["fxamp.true_fp16_skipped"].startswith("onnx.reference cannot run the file")
    assert "'Det'" in meta["fxamp.true_fp16_skipped"]
    assert "not checked in true FP16" in caplog.text
    report = precision_report(str(path), fxamp.plan_of(gm), backend="onnxruntime", inputs=x,
                              reference=model)
    assert report.numerics[0]["true_fp16_skipped"] == meta["fxamp.true_fp16_skipped"]
    assert "true FP16 not checked: onnx.reference cannot run the file" in report.summary()


def _tiny_bert(cls_name, shape):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64)
    return getattr(transformers, cls_name)(cfg).eval(), (torch.randint(0, 100, shape),)


@pytest.mark.slow
@pytest.mark.parametrize("cls_name, shape, dynamic", [
    ("BertModel", (1, 128), False), ("BertForSequenceClassification", (2, 16), False),
    ("BertModel", (2, 128), True)])
def test_berts_file_is_checked_in_true_fp16(tmp_path, caplog, cls_name, shape, dynamic):
    """BERT gathers its ``token_type_ids`` buffer (1, 512) at the position ids
    (GatherElements), where onnx.reference's own fails ("cannot reshape array of size 1
    into shape (1,128)") and the check was skipped. A static file now holds that gather
    folded (``export/constants.py``); with a dynamic sequence axis it stays a node, which
    the check runs with ``reference_ops``' gather. Its error is FP16 rounding's: small,
    and near onnxruntime's on the same file (which computes some ops in FP32 on the CPU,
    so a little smaller)."""
    import numpy as np
    import onnxruntime as ort

    model, x = _tiny_bert(cls_name, shape)
    gm = fxamp.amp_rewrite(model, x, "compute=fp16,target=tensorrt")
    path = str(tmp_path / "bert.onnx")
    export_onnx(gm, x, path, dynamic_shapes=({1: torch.export.Dim.AUTO},) if dynamic
                else None)
    proto, feed = _feed(path, x)
    assert any(n.op_type == "GatherElements" for n in proto.graph.node) == dynamic
    meta = {p.key: p.value for p in proto.metadata_props}
    assert "fxamp.true_fp16_skipped" not in meta and "not checked" not in caplog.text
    error = float(meta["fxamp.true_fp16_error"])  # (a number, not '-')
    assert 0 < error < 1e-2
    with torch.no_grad():
        want = [t for t in (model(*x).values() if isinstance(model(*x), dict)
                            else model(*x)) if isinstance(t, torch.Tensor)]
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    ort_errors = [relative_error(o, w) for o, w in zip(session.run(None, feed), want)]
    assert len(ort_errors) == len(proto.graph.output)
    assert error <= max(10 * max(ort_errors), 2 ** -10)
    # the check's own number, again: the same outputs, the same error
    own = max(relative_error(g, w) for g, w in zip(run_true_fp16(proto, feed), want))
    assert abs(own - error) <= 0.01 * error
    report = precision_report(path, fxamp.plan_of(gm), backend="onnxruntime", inputs=x,
                              reference=model)
    assert all("true_fp16_skipped" not in row for row in report.numerics)
    assert all(row["true_fp16_ok"] for row in report.numerics)
    worst = max(row["true_fp16_max_abs"] / row["ref_max"] for row in report.numerics)
    assert np.isclose(worst, error, rtol=0.01)
    assert "true FP16 (onnx.reference): max abs error" in report.summary()
    assert "true FP16 not checked" not in report.summary()
