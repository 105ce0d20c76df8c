"""A deployment plan is captured once: eval mode, the example's shapes (what export_onnx writes),
and no export under torch.autocast where the only values read from dtypes are attention-mask
fills the plan writes itself. Real Hugging Face models with tiny random configs."""
import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import fxamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _export_models import MODELS  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture
def exports(monkeypatch):
    """The calls of torch.export.export made while the test runs (each one runs)."""
    calls = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(kwargs.get("dynamic_shapes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


@pytest.mark.parametrize("name", ["distilbert_pad", "bert_tiny"])
def test_a_deployment_plan_of_a_masked_encoder_exports_once_static(name, exports):
    model, inputs, check = MODELS[name]()
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(target="tensorrt", frontend="export"))
    assert exports == [None]  # one export, no symbolic dimension, none under autocast
    plan = fxamp.plan_of(gm)
    # (a padding mask gets its fill rule; BERT called without one builds no mask in eager,
    # and none in the export either: frontends/mask_skips.py)
    assert any(p.rule == "mask_fill" for p in plan.nodes.values()) is (name == "distilbert_pad")
    with torch.no_grad():  # the same numbers as the model on another batch of that shape
        assert torch.allclose(gm(*check).float(), model(*check), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name", ["gpt2_tiny", "t5_enc_pad"])
def test_a_deployment_plan_of_a_model_converting_dtypes_exports_once(name, exports):
    """GPT-2's ``softmax(...).to(value.dtype)`` reaches a matmul only; T5's conversions are
    literal ``to(torch.float32)`` / ``float()`` that one eager run under autocast shows are
    the same there (``frontends/dtype_probe.py``): no export under autocast."""
    model, inputs, check = MODELS[name]()
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(target="tensorrt", frontend="export"))
    assert exports == [None]
    with torch.no_grad():
        got, want = gm(*check).float(), model(*check)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_a_static_deployment_plan_refuses_another_batch_saying_why():
    model, inputs, _ = MODELS["distilbert_pad"]()
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(target="tensorrt", frontend="export"))
    ids, mask = inputs
    with pytest.raises(fxamp.InputShapeError, match="deployment plan.*dynamic_shapes"):
        gm(torch.cat([ids, ids]), torch.cat([mask, mask]))


def test_dynamic_shapes_keep_a_deployment_plan_symbolic(exports):
    model, inputs, _ = MODELS["distilbert_pad"]()
    shapes = {"ids": {0: Dim.AUTO}, "mask": {0: Dim.AUTO}}
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(target="tensorrt", frontend="export",
                                                    dynamic_shapes=shapes))
    assert len(exports) == 1 and exports[0] is not None
    ids, mask = inputs
    with torch.no_grad():
        out = gm(torch.cat([ids, ids]), torch.cat([mask, mask]))
        assert torch.allclose(out.float(), model(torch.cat([ids, ids]), torch.cat([mask, mask])),
                              atol=1e-3, rtol=1e-3)
