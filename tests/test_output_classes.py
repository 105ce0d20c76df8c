"""The rewritten module returns the model's own output classes (a Hugging Face
``ModelOutput``, an ``OrderedDict``), with the values autocast gives, on every front end."""
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import fxamp

BF16 = dict(target="cpu", dtype=torch.bfloat16)


def _model_output():
    from transformers.modeling_outputs import SequenceClassifierOutput

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 2)

        def forward(self, x):
            return SequenceClassifierOutput(logits=self.a(x), hidden_states=(x,))

    return Classifier()


class Ordered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)

    def forward(self, x):
        return OrderedDict(out=self.a(x), inp=x)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("make", [_model_output, Ordered], ids=["ModelOutput", "OrderedDict"])
def test_output_class_is_kept(make, frontend):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(3, 4)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    out = gm(x)
    with torch.autocast("cpu", torch.bfloat16):
        ref = model(x)
    assert type(out) is type(ref)
    assert list(out.keys()) == list(ref.keys())
    first = next(iter(ref.keys()))
    assert torch.equal(out[first].float(), ref[first].float())
    out[first].float().sum().backward()
    assert model.a.weight.grad is not None


def test_model_output_attribute_access_works_after_fx_rewrite():
    model = _model_output()
    gm = fxamp.amp_rewrite(model, (torch.randn(3, 4),),
                           fxamp.RewriteConfig.make(frontend="fx", **BF16))
    out = gm(torch.randn(3, 4))
    assert out.logits.shape == (3, 2) and isinstance(out.hidden_states, tuple)
    plan = fxamp.plan_of(gm)
    assert all(p.rule != "custom_ops" for p in plan.nodes.values())  # a container, no op


def test_a_model_output_gets_its_fields_in_the_output_dtype_in_place():
    """Block mode and the eager root cast a Hugging Face ``ModelOutput`` the model's
    forward made on this call field by field, keeping the object (rebuilding one per call
    ran its dataclass machinery: about 120 Python calls); other containers are rebuilt."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    from fxamp.frontends.common import in_output_dtype

    logits, hidden = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(2, 4)
    out = SequenceClassifierOutput(logits=logits, hidden_states=(hidden.bfloat16(), hidden))
    got = in_output_dtype(out, torch.float32)
    assert got is out and type(got) is SequenceClassifierOutput
    assert got.logits.dtype == torch.float32 and torch.equal(got.logits, logits.float())
    assert got["logits"] is got.logits and got.loss is None and "loss" not in got
    assert [t.dtype for t in got.hidden_states] == [torch.float32] * 2
    assert got.hidden_states[1] is hidden  # (already FP32: as it was)
    plain = {"logits": logits}
    assert in_output_dtype(plain, torch.float32) is not plain
    assert plain["logits"] is logits  # (a plain dict is not changed)
