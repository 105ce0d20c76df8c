"""The export's checks at a bounded cost (issue "Deployment at real sizes"): the true-FP16
run frees its intermediates and samples a huge projection output, FP16 Gemms run with
PyTorch's kernel, the dtype probe runs on fake tensors with the same decisions, and the
precision report reads the export's true-FP16 result back instead of running it again."""
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.export import export_onnx, precision_report
from fxamp.export import true_fp16
from fxamp.frontends import dtype_probe

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _export_models  # noqa: E402

DEPLOY = "compute=fp16,target=tensorrt"


class _Head(nn.Module):
    """An embedding, a norm and a projection to a large vocabulary (a language model's
    logits, small)."""

    def __init__(self, vocab: int = 3000) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.tok(ids)))


def _head_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int):
    monkeypatch.setattr(true_fp16, "SAMPLE_LIMIT", limit)
    torch.manual_seed(0)
    model, ids = _Head().eval(), (torch.randint(0, 3000, (2, 8)),)
    path = export_onnx(fxamp.amp_rewrite(model, ids, DEPLOY), ids, str(tmp_path / "m.onnx"))
    return model, ids, onnx.load(path), path


def _meta(proto) -> dict:
    return {p.key: p.value for p in proto.metadata_props}


def test_the_true_fp16_check_compares_a_bounded_sample_of_a_huge_projection_output(
        tmp_path, monkeypatch):
    _, ids, proto, _ = _head_export(tmp_path, monkeypatch, 4000)
    meta = _meta(proto)
    import json

    (row,) = json.loads(meta[true_fp16.ROWS_KEY])
    assert row["of"] == 2 * 8 * 3000 and 0 < row["values"] <= 4000
    assert "every" in meta[true_fp16.SAMPLED_KEY] and str(row["values"]) in row["sampled"]
    assert float(meta["fxamp.true_fp16_error"]) < 0.05


def test_the_sample_is_the_same_columns_of_the_whole_run(tmp_path, monkeypatch):
    from fxamp.export.reference_ops import evaluator

    _, ids, proto, _ = _head_export(tmp_path, monkeypatch, 10 ** 9)
    feed = {proto.graph.input[0].name: ids[0].numpy()}
    whole = evaluator(proto).run(None, feed)
    run = true_fp16.run_bounded(proto, feed, limit=5000)
    (sampled,) = run.sampled.values()
    assert sampled.evaluated <= 5000 and sampled.total == whole[0].size
    assert np.array_equal(run.outputs[0], whole[0][..., ::sampled.stride])


def test_the_bounded_run_frees_intermediates_and_gives_the_evaluators_outputs(tmp_path):
    from fxamp.export.reference_ops import evaluator

    model, ids, _ = _export_models.gpt2_tiny()
    path = export_onnx(fxamp.amp_rewrite(model, ids, DEPLOY), ids, str(tmp_path / "g.onnx"))
    proto = onnx.load(path)
    feed = {proto.graph.input[0].name: ids[0].numpy()}
    run = true_fp16.run_bounded(proto, feed)
    assert run.freed > 10 and not run.sampled  # (its 16x512 logits are within the limit)
    for got, want in zip(run.outputs, evaluator(proto).run(None, feed)):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("trans_b,alpha,beta,bias", [(0, 1.0, 1.0, True), (1, 0.5, 2.0, True),
                                                     (1, 1.0, 1.0, False)])
def test_the_fp16_gemm_kernel_rounds_as_onnx_reference(trans_b, alpha, beta, bias):
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from fxamp.export.reference_ops import evaluator

    rng = np.random.default_rng(0)
    feed = {"A": rng.standard_normal((6, 40)).astype(np.float16),
            "B": rng.standard_normal((9, 40) if trans_b else (40, 9)).astype(np.float16)}
    if bias:
        feed["C"] = rng.standard_normal(9).astype(np.float16)
    node = helper.make_node("Gemm", list(feed), ["Y"], alpha=alpha, beta=beta, transB=trans_b)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        n, TensorProto.FLOAT16, None) for n in feed], [helper.make_tensor_value_info(
            "Y", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (want,), (got,) = ReferenceEvaluator(model).run(None, feed), evaluator(model).run(None, feed)
    assert got.dtype == np.float16 and np.array_equal(got, want)


def test_the_report_reads_the_exports_true_fp16_result_back(tmp_path, monkeypatch):
    model, ids, _, path = _head_export(tmp_path, monkeypatch, 10 ** 9)
    ran: List[int] = []
    real = true_fp16.run_bounded
    monkeypatch.setattr(true_fp16, "run_bounded", lambda *a, **k: ran.append(1) or real(*a, **k))
    report = precision_report(path, backend="onnxruntime", inputs=ids, reference=model)
    (row,) = report.numerics
    assert row["true_fp16_from"] == "export check" and row["true_fp16_ok"] and not ran
    other = (torch.randint(0, 3000, (2, 8)),)  # (other inputs: the report runs it itself)
    report = precision_report(path, backend="onnxruntime", inputs=other, reference=model)
    (row,) = report.numerics
    assert "true_fp16_from" not in row and row["true_fp16_ok"] and ran == [1]


# -- the dtype probe on fake tensors (frontends/dtype_probe.py) -----------------------------

def _model_frames(seen):
    """The conversions with the frames of the model's code only (the caller's differ)."""
    return [(tuple(f for f in frames if "site-packages" in f[0]), a, b) for frames, a, b in seen]


@pytest.mark.parametrize("factory", ["gpt2_tiny", "t5_encoder"])
def test_the_fake_probe_records_the_eager_runs_conversions(factory):
    model, args, _ = getattr(_export_models, factory)()

    def run():
        return model(*args)

    fake = dtype_probe.fake_conversions(run, "cpu", torch.float16)
    recorder = dtype_probe._Recorder()
    with torch.no_grad(), torch.autocast("cpu", torch.float16), recorder:
        run()
    assert fake and _model_frames(fake) == _model_frames(recorder.seen)


@pytest.mark.parametrize("factory", ["gpt2_tiny", "t5_encoder"])
def test_the_fake_probe_gives_the_plan_the_eager_probe_gave(factory, monkeypatch):
    model, args, _ = getattr(_export_models, factory)()
    calls: List[bool] = []
    real = dtype_probe.fake_conversions
    monkeypatch.setattr(dtype_probe, "fake_conversions",
                        lambda *a: calls.append(True) or real(*a))
    fake_plan = fxamp.plan_of(fxamp.amp_rewrite(model, args, DEPLOY)).to_text()
    monkeypatch.setattr(dtype_probe, "fake_conversions", lambda *a: None)  # (eager, as before)
    eager_plan = fxamp.plan_of(fxamp.amp_rewrite(model, args, DEPLOY)).to_text()
    assert calls and fake_plan == eager_plan


class _Cache(nn.Module):
    """A forward that stores a tensor on its module (a rotary table's cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.ones(4)
        return self.lin(x).float() * self.table


def test_the_fake_probe_leaves_no_fake_tensor_on_the_model():
    model, x = _Cache().eval(), torch.randn(2, 4)
    seen = dtype_probe.fake_conversions(lambda: model(x), "cpu", torch.float16)
    assert seen == [(seen[0][0], torch.float16, torch.float32)]
    assert model.table is None and torch.equal(model(x), model.lin(x) * 1.0)


def test_a_forward_that_needs_values_falls_back_to_the_real_run():
    class Branch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float() if bool(x.sum() > 0) else x.half()

    x = torch.ones(3)
    assert dtype_probe.fake_conversions(lambda: Branch()(x), "cpu", torch.float16) is None
    seen = dtype_probe.conversions(lambda: Branch()(x), "cpu", torch.float16)
    assert seen is not None and [s[1:] for s in seen] == [(torch.float32, torch.float32)]
