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


@pytest.mark.slow
def test_a_file_the_reference_evaluator_cannot_run_says_so_in_its_metadata(tmp_path, caplog):
    """BERT's file: onnx.reference fails inside GatherElements. The true-FP16 check was
    skipped with an INFO line and a bare '-'; now a warning and the file's metadata say
    it was not checked, and why."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 16))
    gm = fxamp.amp_rewrite(model, (ids,), "compute=fp16,target=tensorrt")
    path = tmp_path / "bert.onnx"
    export_onnx(gm, (ids,), str(path))
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta["fxamp.true_fp16_error"] == "-"
    assert meta["fxamp.true_fp16_skipped"].startswith("onnx.reference cannot run the file")
    assert "not checked in true FP16" in caplog.text
