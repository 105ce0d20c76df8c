"""Hooks registered after the rewrite: on a submodule the graph calls they run (looked up at
call time); on one whose ops are traced into the graph a returned module's call refuses,
naming it, and an in-place model is planned again on that call, the hooked submodule kept as
a call that runs them."""
import copy

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import UnsupportedModelError

BF16 = dict(target="cpu", dtype=torch.bfloat16)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_hook_added_after_the_rewrite_is_not_silently_skipped(frontend):
    model = _model()
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),),
                           fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    gm(torch.randn(2, 4))
    seen = []
    handle = model[1].register_forward_hook(lambda m, i, o: seen.append(o))
    with pytest.raises(UnsupportedModelError, match=r"1 \(forward_hook: .*lambda"):
        gm(torch.randn(2, 4))
    handle.remove()  # removed again: the graph runs as before
    assert gm(torch.randn(2, 4)).shape == (2, 4)


def test_in_place_a_hook_added_after_the_rewrite_runs_once_per_call_like_autocast(caplog):
    """The ahead-of-time graph of the whole model (``partition="flat"``) ran Block 1's ops inline: the call that finds the hook plans
    the model again (a warning says why), with Block 1 kept as a call; the hook runs on
    every call after (once each; the planning call's fake run of the kept call passes
    through it too, as for a hook registered before a rewrite) and the outputs are
    autocast's with the same hook."""
    model = _model()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4)
    fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(frontend="fx", partition="flat",
                                                             **BF16), inplace=True)
    model(x)
    calls = []
    model[1].register_forward_hook(lambda m, i, o: calls.append(1) or o * 2)
    ref[1].register_forward_hook(lambda m, i, o: o * 2)
    with caplog.at_level("WARNING", logger="fxamp"):
        out = model(x)
    assert "hooks were registered on 1 (forward_hook" in caplog.text
    with torch.autocast("cpu", torch.bfloat16):
        want = ref(x)
    assert calls and torch.equal(out, want.float())
    planned = len(calls)
    assert torch.equal(model(x), out) and len(calls) == planned + 1


def test_hooks_of_a_module_kept_as_a_call_are_live():
    model = _model()
    model[1].register_forward_hook(lambda m, i, o: None)  # kept as a call
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),),
                           fxamp.RewriteConfig.make(frontend="fx", **BF16))
    ref = copy.deepcopy(model)
    calls = []
    model[1].register_forward_hook(lambda m, i, o: calls.append(1) or o * 2)
    ref[1].register_forward_hook(lambda m, i, o: o * 2)
    x = torch.randn(2, 4)
    out = gm(x)
    with torch.autocast("cpu", torch.bfloat16):
        want = ref(x)
    assert calls == [1] and torch.equal(out.float(), want.float())


def test_no_hook_added_costs_no_error_and_the_plan_is_unchanged():
    model = _model()
    plain = fxamp.amp_rewrite(copy.deepcopy(model), (torch.randn(2, 4),),
                              fxamp.RewriteConfig.make(frontend="fx", **BF16))
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),),
                           fxamp.RewriteConfig.make(frontend="fx", **BF16))
    nn.Linear(2, 2).register_forward_hook(lambda m, i, o: None)  # an unrelated module
    assert gm(torch.randn(2, 4)).shape == (2, 4)
    assert fxamp.plan_of(gm).to_text() == fxamp.plan_of(plain).to_text()
