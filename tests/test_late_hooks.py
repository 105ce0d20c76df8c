"""Hooks registered after the rewrite: on a submodule the graph calls they run (looked up at
call time); on one whose ops are traced into the graph the call refuses, naming it."""
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
@pytest.mark.parametrize("inplace", [False, True])
def test_a_hook_added_after_the_rewrite_is_not_silently_skipped(frontend, inplace):
    model = _model()
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),), frontend=frontend, inplace=inplace,
                           **BF16)
    gm(torch.randn(2, 4))
    seen = []
    handle = model[1].register_forward_hook(lambda m, i, o: seen.append(o))
    with pytest.raises(UnsupportedModelError, match=r"1 \(forward_hook: .*lambda"):
        gm(torch.randn(2, 4))
    handle.remove()  # removed again: the graph runs as before
    assert gm(torch.randn(2, 4)).shape == (2, 4)


def test_hooks_of_a_module_kept_as_a_call_are_live():
    model = _model()
    model[1].register_forward_hook(lambda m, i, o: None)  # kept as a call
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),), frontend="fx", **BF16)
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
    plain = fxamp.amp_rewrite(copy.deepcopy(model), (torch.randn(2, 4),), frontend="fx", **BF16)
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),), frontend="fx", **BF16)
    nn.Linear(2, 2).register_forward_hook(lambda m, i, o: None)  # an unrelated module
    assert gm(torch.randn(2, 4)).shape == (2, 4)
    assert fxamp.plan_of(gm).to_text() == fxamp.plan_of(plain).to_text()
