"""amp_rewrite's signature: ``amp_rewrite(model, example_inputs, config, *, inplace)``.
The config is a ``RewriteConfig`` (``RewriteConfig.make(...)``), a ``Policy`` or a policy's
text (recipe names included); the keywords the config holds are still taken for one release
with a FutureWarning and give the same plan."""
from __future__ import annotations

# codemod_amp: skip-file (these tests call amp_rewrite with the deprecated keywords)

import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import RewriteConfig
from fxamp.policy import RECIPES, Policy

BF16 = torch.bfloat16


class Net(nn.Module):
    """A linear, a layer norm and a softmax, with an optional keyword input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, scale=None):
        y = self.norm(self.lin(x))
        if scale is not None:
            y = y * scale
        return torch.softmax(y, dim=-1).sum()


class KeepLinearFp32(fxamp.DecisionRule):
    name = "user:keep_linear"

    def applies(self, node):
        return self.label(node) == "nn.Linear"

    def decide(self, node):
        return {node: self.verdict(torch.float32, "kept in FP32 by the test")}


def _net():
    torch.manual_seed(0)
    return Net()


X = torch.randn(4, 8)
#: each deprecated keyword, a value that changes the plan or the config
OLD_KEYWORDS = {
    "dtype": BF16,
    "target": "cpu",
    "policy": "fp32:norm",
    "frontend": "export",
    "example_kwargs": {"scale": torch.tensor(2.0)},
    "calibration_data": [(X * 1000,)],
    "dynamic_shapes": ({0: torch.export.Dim.AUTO},),
    "rules": [KeepLinearFp32()],
}


def _plan(gm) -> str:
    return fxamp.plan_of(gm).to_text()


@pytest.mark.parametrize("name", list(OLD_KEYWORDS))
def test_each_old_keyword_warns_once_and_plans_as_the_config(name):
    value = OLD_KEYWORDS[name]
    with pytest.warns(FutureWarning) as record:
        old = fxamp.amp_rewrite(_net(), (X,), **{name: value})
    ours = [w for w in record if "amp_rewrite" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in record]
    message = str(ours[0].message)
    assert f"fxamp.RewriteConfig.make({name}=...)" in message
    assert ours[0].filename == __file__  # (points at the caller's line)
    new = fxamp.amp_rewrite(_net(), (X,), RewriteConfig.make(**{name: value}))
    assert _plan(old) == _plan(new)
    assert fxamp.config_of(old) == fxamp.config_of(new)


def test_several_old_keywords_warn_once_naming_each():
    with pytest.warns(FutureWarning) as record:
        old = fxamp.amp_rewrite(_net(), (X,), dtype=BF16, target="cpu", policy="fp32:norm",
                                inplace=True)
    ours = [str(w.message) for w in record if "amp_rewrite" in str(w.message)]
    assert len(ours) == 1
    assert "RewriteConfig.make(dtype=..., target=..., policy=...)" in ours[0]
    new = fxamp.amp_rewrite(_net(), (X,), RewriteConfig.make(dtype=BF16, target="cpu",
                                                             policy="fp32:norm"), inplace=True)
    assert _plan(old) == _plan(new)


def test_the_new_spelling_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.filterwarnings("ignore", "`treespec", FutureWarning)  # (torch's own)
        fxamp.amp_rewrite(_net(), (X,), RewriteConfig.make(dtype=BF16, target="cpu"))
        fxamp.amp_rewrite(_net(), (X,), "cpu-bf16", inplace=True)
        fxamp.amp_rewrite(_net(), (X,), config=RewriteConfig.make(frontend="export"))


def test_a_policy_text_is_the_config_it_makes():
    text = "compute=bf16,target=cpu,fp32:norm"
    by_text = fxamp.amp_rewrite(_net(), (X,), text)
    by_make = fxamp.amp_rewrite(_net(), (X,), RewriteConfig.make(dtype=BF16, target="cpu",
                                                                 policy="fp32:norm"))
    by_policy = fxamp.amp_rewrite(_net(), (X,), Policy.parse(text))
    assert _plan(by_text) == _plan(by_make) == _plan(by_policy)
    assert fxamp.config_of(by_text) == fxamp.config_of(by_make)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_is_its_policy_text(recipe):
    text = RECIPES[recipe]
    assert Policy.parse(recipe) == Policy.parse(text)
    assert RewriteConfig.make(policy=recipe) == RewriteConfig.make(policy=text)
    assert _plan(fxamp.amp_rewrite(_net(), (X,), recipe)) == \
        _plan(fxamp.amp_rewrite(_net(), (X,), text))
    # a recipe takes more items after it, and the target it names wins over the device's
    extended = Policy.parse(f"{recipe},fp32:norm")
    assert str(extended) == str(Policy.parse(f"{text},fp32:norm"))
    assert not RewriteConfig.make(policy=recipe).follow_device


def test_the_recipes_are_the_training_and_deployment_defaults():
    assert str(Policy.parse("cpu-bf16")) == "compute=bf16,target=cpu"
    assert str(Policy.parse("cuda-fp16")) == "compute=fp16,target=cuda"
    assert str(Policy.parse("tensorrt")) == "compute=fp16,target=tensorrt"


def test_a_misspelt_recipe_names_the_recipes():
    with pytest.raises(fxamp.PolicyError, match=r"did you mean 'cpu-bf16'.*cuda-fp16"):
        fxamp.amp_rewrite(_net(), (X,), "cpu_bf16")


def test_config_with_old_keywords_is_refused():
    with pytest.raises(fxamp.FxampError, match="either config= or the keywords"):
        fxamp.amp_rewrite(_net(), (X,), RewriteConfig.make(), dtype=BF16)
    with pytest.raises(fxamp.FxampError, match="got config= and policy"):
        fxamp.amp_rewrite(_net(), (X,), "cpu-bf16", policy="fp32:norm")


def test_unknown_keywords_and_arguments_raise_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'dtypes'"):
        fxamp.amp_rewrite(_net(), (X,), dtypes=BF16)
    with pytest.raises(TypeError):
        fxamp.amp_rewrite(_net(), (X,), "cpu-bf16", True)  # (inplace is keyword-only)


def test_a_config_of_another_type_is_refused_by_name():
    with pytest.raises(fxamp.FxampError, match="got dtype; what to do: fxamp.RewriteConfig"):
        fxamp.amp_rewrite(_net(), (X,), BF16)  # (the old habit: a dtype positionally)
