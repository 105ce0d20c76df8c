"""A deployment plan writes an attention mask's ``finfo(float32).min`` fill as FP16's lowest
finite value, so the mask arithmetic stays FP16 and the file has fewer Casts; the file stays
right in true FP16 (onnx.reference), a fully padded row included."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxamp

onnx = pytest.importorskip("onnx")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class Masked(nn.Module):
    """Scores masked the way Hugging Face's eager attention masks them: an additive mask
    ``where(mask, 0, finfo(float32).min)`` before the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        fill = torch.finfo(torch.float32).min
        add = torch.where(mask[:, None, :].bool(), torch.zeros((), dtype=torch.float32), fill)
        return torch.softmax(scores + add, -1) @ self.v(x)


def _masked():
    torch.manual_seed(0)
    x, mask = torch.randn(2, 6, 16), torch.ones(2, 6)
    mask[1, 4:] = 0
    return Masked().eval(), (x, mask)


def _plan(model, x, policy=None):
    return fxamp.plan_of(fxamp.amp_rewrite(model, x,
                                           fxamp.RewriteConfig.make(target="tensorrt",
                                                                    policy=policy)))


def test_a_deployment_plan_keeps_the_mask_arithmetic_in_fp16_with_a_reason():
    model, x = _masked()
    plan = _plan(model, x)
    where = plan.nodes["where"]
    assert where.dtype == torch.float16 and where.rule == "mask_fill", plan.to_text()
    assert "fill -3.4e+38 is written as fp16's lowest -65504" in where.reason
    assert plan.nodes["add"].dtype == torch.float16
    assert plan.nodes["softmax"].dtype == torch.float16
    before = _plan(model, x, policy="off:mask_fill")  # what the rule changes
    assert before.nodes["add"].dtype == torch.float32 and before.nodes["add"].rule == "ranges"


class CausalInf(nn.Module):
    """A causal mask built as ``full(-inf).triu(1)`` and a padding ``masked_fill(-1e9)``."""

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)
        scores = (x @ x.transpose(-1, -2)).masked_fill(pad[:, None, :] == 0, -1e9)
        return torch.softmax(scores + causal, -1) @ x


def test_minus_inf_and_minus_1e9_fills_of_a_causal_and_a_padding_mask_go_fp16(tmp_path):
    from fxamp.export import export_onnx, run_true_fp16

    torch.manual_seed(0)
    x, pad = torch.randn(2, 6, 8), torch.ones(2, 6)
    pad[1, 4:] = 0
    model = CausalInf().eval()
    gm = fxamp.amp_rewrite(model, (x, pad), fxamp.RewriteConfig.make(target="tensorrt"))
    plan = fxamp.plan_of(gm)
    fills = {n: p for n, p in plan.nodes.items() if p.rule == "mask_fill"}
    assert sorted(fills) == ["full", "masked_fill"], plan.to_text()
    assert "fill -inf is written" in fills["full"].reason
    assert "fill -1e+09 is written" in fills["masked_fill"].reason
    assert plan.nodes["softmax"].dtype == torch.float16
    proto = onnx.load(export_onnx(gm, (x, pad), str(tmp_path / "c.onnx")))
    names = [i.name for i in proto.graph.input]
    got = run_true_fp16(proto, dict(zip(names, (x.numpy(), pad.numpy()))))[0]
    with torch.no_grad():
        want = model(x, pad).numpy()
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()


class MaskOut(Masked):
    """The same attention, and its additive mask returned as an output too."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        fill = torch.finfo(torch.float32).min
        add = torch.where(mask[:, None, :].bool(), torch.zeros((), dtype=torch.float32), fill)
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) + add, -1), add


def test_a_fill_whose_value_is_used_elsewhere_is_left_alone():
    _, x = _masked()
    model = MaskOut().eval()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    plan = fxamp.plan_of(gm)
    assert not any(p.rule == "mask_fill" for p in plan.nodes.values()), plan.to_text()
    with torch.no_grad():
        assert torch.equal(gm(*x)[1], model(*x)[1])  # the model's own -3.4e38


def test_a_training_plan_and_a_large_score_leave_the_fill_alone():
    model, x = _masked()
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="cuda")))
    assert "written as fp16's lowest" not in plan.nodes["where"].reason
    with torch.no_grad():  # scores past the deployment limit (512) are still FP32
        model.q.weight.mul_(400.0)
    plan = _plan(model, x)
    assert plan.nodes["where"].dtype == torch.float16
    assert plan.nodes["truediv"].dtype == torch.float32, plan.to_text()


def test_the_rewritten_model_computes_the_model_and_its_fp32_reference_keeps_the_fill():
    from fxamp.export.reference import fp32_reference

    model, x = _masked()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt"))
    with torch.no_grad():
        want = model(*x)
    assert torch.equal(fp32_reference(gm)(*x), want)
    x_full = (x[0], torch.zeros_like(x[1]))  # every position padded: uniform attention
    with torch.no_grad():
        assert torch.equal(fp32_reference(gm)(*x_full), model(*x_full))


def _file_casts_and_error(tmp_path, name, policy):
    from _export_models import MODELS, check_batches

    from fxamp.export import export_onnx, run_true_fp16

    model, x, check = MODELS[name]()
    gm = fxamp.amp_rewrite(model, x, fxamp.RewriteConfig.make(target="tensorrt", policy=policy))
    proto = onnx.load(export_onnx(gm, x, str(tmp_path / f"{name}.{bool(policy)}.onnx")))
    inits = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    batches = check_batches(name, check, 8)
    ids, mask = batches[-1]
    mask = mask.clone()
    mask[1] = 0  # a fully padded sequence
    errors = []
    for batch in batches + [(ids, mask)]:
        got = run_true_fp16(proto, {n: t.numpy() for n, t in zip(names, batch)})[0]
        with torch.no_grad():
            want = model(*batch).numpy()
        assert np.isfinite(got).all()
        errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
    casts = sum(n.op_type == "Cast" for n in proto.graph.node)
    return casts, float(np.mean(errors[:8])), errors[8]


@pytest.mark.slow  # two exports of a DistilBERT, nine true-FP16 runs each
def test_a_padded_distilbert_file_has_fewer_casts_and_the_same_error(tmp_path):
    casts, mean, padded = _file_casts_and_error(tmp_path, "distilbert_pad", None)
    casts0, mean0, _ = _file_casts_and_error(tmp_path, "distilbert_pad", "off:mask_fill")
    assert casts0 == 6 and casts == 2  # onnxconverter-common's file: 2
    assert mean <= 1.1 * mean0 + 1e-6 and mean < 1e-2  # mean over 8 batches, relative
    assert padded < 1e-2  # a fully padded sequence: right in true FP16
