"""Policy: string form, aliases, overrides, errors."""
import pytest
import torch

import fxamp
from fxamp.policy import Override, Policy, make_policy


def test_parse_with_aliases_and_defaults():
    p = Policy.parse("compute=half,target=cpu")
    assert p.compute is torch.float16 and p.target == "cpu" and p.overrides == ()
    assert Policy.parse("compute=bfloat16").compute is torch.bfloat16
    assert Policy.parse("").target == "cuda"


def test_string_form_round_trips():
    p = Policy.parse("compute=bf16,target=cpu,fp32:encoder.layer.0.*,fp16:F.softmax")
    assert str(p) == "compute=bf16,target=cpu,fp32:encoder.layer.0.*,fp16:F.softmax"
    assert Policy.parse(str(p)) == p


def test_overrides_match_node_module_or_op_and_later_wins():
    p = Policy.parse("fp32:encoder.*,fp16:encoder.ln")
    assert p.override_for("x", "encoder.fc", "nn.Linear") == Override(torch.float32, "encoder.*")
    assert p.override_for("x", "encoder.ln", "nn.LayerNorm").dtype is torch.float16
    assert p.override_for("x", "decoder.fc", "nn.Linear") is None
    assert Policy.parse("fp32:nn.Linear").override_for("fc", "fc", "nn.Linear") is not None


@pytest.mark.parametrize("text, match", [
    ("compute=fp16,colour=red", "valid keys: compute, target, output"),
    ("compute=fp64x", "unknown dtype"),
    ("target=tpu", "valid targets: cuda, cpu"),
    ("compute=fp32", "float16 or torch.bfloat16"),
    ("fp32:", "no pattern"),
    ("banana", "cannot read policy item"),
])
def test_bad_policies_raise_value_errors_listing_valid_choices(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(text)
    with pytest.raises(fxamp.FxampError):
        Policy.parse(text)


def test_make_policy_uses_dtype_and_target_under_a_string():
    p = make_policy("fp32:head", torch.bfloat16, "cpu")
    assert p.compute is torch.bfloat16 and p.target == "cpu" and len(p.overrides) == 1
    assert make_policy(None, torch.float16, "cuda") == Policy()
