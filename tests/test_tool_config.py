"""``fxamp.audit``, ``fxamp.search`` and ``fxamp.bisect_baseline`` take ``config`` as
``amp_rewrite`` does (a ``RewriteConfig``, a ``Policy``, a policy text or None); their old
keywords (``dtype``, ``target``, ``policy``, ``frontend``, audit's ``example_kwargs``) still
work for one release with a ``FutureWarning`` naming the new spelling, and ``config``
together with one of them is refused."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import RewriteConfig


class Sensitive(nn.Module):
    """A small MLP where one spot scales values into fp16's subnormals and back."""

    def __init__(self, depth=4, spots=(1,)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))
        self.spots = spots

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i in self.spots:
                x = (x * 1e-6) * 1e6
        return x


class Findings(nn.Module):
    """Dims off a multiple of 8, a ``.half()`` by hand and an ``exp`` without a max shift."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 20)
        self.norm = nn.LayerNorm(20, eps=1e-12)

    def forward(self, x, scale=1.0):
        h = self.norm(self.fc(x)) * scale
        w = torch.exp(h @ h.transpose(-1, -2))
        return F.linear(w, torch.eye(w.shape[-1])).half().float()


def _search_setup():
    torch.manual_seed(0)
    model = Sensitive()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    return model, data[0], data


def _same_search(a: fxamp.SearchResult, b: fxamp.SearchResult) -> None:
    assert (a.fp32_nodes, a.evaluations, a.error, a.met, a.history) == \
        (b.fp32_nodes, b.evaluations, b.error, b.met, b.history)
    assert fxamp.config_of(a.graph_module) == fxamp.config_of(b.graph_module)
    assert fxamp.plan_of(a.graph_module).to_text() == fxamp.plan_of(b.graph_module).to_text()


# -- search and bisect_baseline ---------------------------------------------------------
@pytest.mark.parametrize("tool", ["search", "bisect_baseline"])
def test_the_config_spelling_gives_what_the_old_keywords_gave(tool):
    run = getattr(fxamp, tool)
    model, inputs, data = _search_setup()
    with pytest.warns(FutureWarning) as caught:
        old = run(model, inputs, data, rtol=5e-3, target="cpu", dtype=torch.float16)
    warned = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"{tool}(..., target=..., dtype=...) is deprecated")
    assert (f"{tool}(model, example_inputs, data, "
            "fxamp.RewriteConfig.make(target=..., dtype=...))") in warned[0]
    assert caught[0].filename == __file__  # (it points at the caller, past the progress bar)
    assert old.met and old.fp32_nodes, old  # (the search had something to do)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # (the new spellings warn nothing)
        spellings = [
            run(model, inputs, data, config=RewriteConfig.make(target="cpu",
                                                               dtype=torch.float16),
                rtol=5e-3),
            run(model, inputs, data, RewriteConfig.make(target="cpu"), rtol=5e-3),
            run(model, inputs, data, "compute=fp16,target=cpu", rtol=5e-3),
            run(model, inputs, data, fxamp.Policy.parse("target=cpu"), rtol=5e-3),
        ]
    for new in spellings:
        _same_search(new, old)


@pytest.mark.parametrize("tool", ["search", "bisect_baseline"])
def test_config_and_an_old_keyword_together_are_refused(tool):
    run = getattr(fxamp, tool)
    model, inputs, data = _search_setup()
    with pytest.raises(fxamp.FxampError, match=rf"{tool} takes either config= or the keywords "
                                               r"it holds, not both: got config= and target"):
        run(model, inputs, data, RewriteConfig.make(), rtol=5e-3, target="cpu")
    with pytest.raises(fxamp.FxampError, match="not both"):
        run(model, inputs, data, config="compute=bf16", frontend="fx")
    with pytest.raises(TypeError, match=rf"{tool}\(\) got an unexpected keyword argument "
                                        r"'calibration_data'"):
        run(model, inputs, data, calibration_data=data)  # (never one of its keywords)


def test_search_without_a_config_follows_the_models_device():
    model, inputs, data = _search_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        found = fxamp.search(model, inputs, data, rtol=10.0)
    assert str(fxamp.config_of(found.graph_module).policy) == "compute=fp16,target=cpu"


# -- audit --------------------------------------------------------------------------------
def _codes(findings):
    return [str(f) for f in findings]


def test_audit_config_spelling_gives_the_old_keywords_findings():
    torch.manual_seed(0)
    model, x = Findings(), torch.randn(4, 16)
    with pytest.warns(FutureWarning) as caught:
        old = fxamp.audit(model, (x,), target="cpu", policy="fp32:fc",
                          example_kwargs={"scale": 2.0})
    warned = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(warned) == 1, warned
    assert warned[0].startswith("audit(..., target=..., policy=..., example_kwargs=...) is "
                                "deprecated")
    assert ("audit(model, example_inputs, fxamp.RewriteConfig.make(target=..., policy=..., "
            "example_kwargs=...))") in warned[0]
    assert caught[0].filename == __file__
    assert {"dims-not-multiple-of-8", "exp-without-max-shift", "explicit-cast"} <= \
        {f.code for f in old}, _codes(old)
    config = RewriteConfig.make(target="cpu", policy="fp32:fc", example_kwargs={"scale": 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # (the new spellings warn nothing)
        new = fxamp.audit(model, (x,), config)
        by_keyword = fxamp.audit(model, (x,), config=config)
        text = fxamp.audit(model, (x,), "target=cpu,fp32:fc")
    assert _codes(new) == _codes(by_keyword) == _codes(old)
    assert _codes(text) == _codes(fxamp.audit(model, (x,), RewriteConfig.make(
        target="cpu", policy="fp32:fc")))


def test_audit_refuses_config_with_an_old_keyword():
    model, x = Findings(), torch.randn(4, 16)
    with pytest.raises(fxamp.FxampError, match=r"audit takes either config= or the keywords it "
                                               r"holds, not both: got config= and dtype"):
        fxamp.audit(model, (x,), RewriteConfig.make(target="cpu"), dtype=torch.bfloat16)
    with pytest.raises(fxamp.FxampError, match="not both: got config= and example_kwargs"):
        fxamp.audit(model, (x,), config="target=cpu", example_kwargs={"scale": 2.0})
    with pytest.raises(TypeError, match=r"audit\(\) got an unexpected keyword argument "
                                        r"'rules'"):
        fxamp.audit(model, (x,), rules=[])


def test_a_config_that_follows_the_device_is_resolved_for_the_audit():
    """A config without a target follows the model's device, as amp_rewrite's does: the
    audit's checks read the policy the rewrite planned with (target cpu), not the
    placeholder (cuda, where autocast refuses binary_cross_entropy: an error)."""

    class BCE(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, y):
            return F.binary_cross_entropy(torch.sigmoid(self.fc(x)), y)

    model, inputs = BCE(), (torch.randn(4, 8), torch.rand(4, 8))
    followed = fxamp.audit(model, inputs, RewriteConfig.make())
    assert [f.severity for f in followed if f.code == "binary-cross-entropy"] == ["warning"]
    assert _codes(followed) == _codes(fxamp.audit(model, inputs, "target=cpu"))
