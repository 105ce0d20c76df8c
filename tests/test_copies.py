"""deepcopy and pickle of a rewritten module work, or raise an FxampError that says what to
do (frontends/copies.py): never torch's own error from deep inside."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import fxamp
from test_frontends import ShapeBranch  # torch.fx cannot branch on a shape

BF16 = torch.bfloat16
X = torch.randn(2, 8)


class ValueBranch(nn.Module):
    """No tracer takes its forward (a branch on a value): the eager front end."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if float(h.sum()) > 1e9:
            h = h * 2
        return self.b(h)


def _rewrite(cls, inplace=False):
    torch.manual_seed(0)
    return fxamp.amp_rewrite(cls(), (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                             inplace=inplace)


@pytest.mark.parametrize("inplace", [False, True])
def test_an_export_result_deep_copies_and_refuses_pickling_with_what_to_do(inplace):
    gm = _rewrite(ShapeBranch, inplace)
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    twin = copy.deepcopy(gm)
    assert torch.equal(twin(X), gm(X))
    with pytest.raises(fxamp.UnsupportedModelError, match="rewrite of .*ShapeBranch is not "
                                                          ".*what to do: copy or pickle the "
                                                          "original FP32 model"):
        pickle.dumps(gm)  # (named by the model's class: it said 'GraphModule')


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("how", [copy.deepcopy, pickle.dumps])
def test_an_eager_result_refuses_deepcopy_and_pickling_with_what_to_do(inplace, how):
    gm = _rewrite(ValueBranch, inplace)
    assert fxamp.plan_of(gm).header["frontend"] == "eager"
    with pytest.raises(fxamp.UnsupportedModelError, match="eager-front-end rewrite of "
                                                          "ValueBranch.*state_dict"):
        how(gm)
