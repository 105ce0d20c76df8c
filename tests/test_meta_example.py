"""Example inputs on device ``meta`` for a model on cpu.

Such a model cannot run on its example (every call mixes two devices), so nothing about
it can be observed there: the rewrite refuses it up front on every front end, naming both
devices and what to do, instead of planning every Linear / LayerNorm as a ``runtime`` call
with a reason that claims an observation (fx) or a raw device-mismatch TraceError (export).
The advice is followed: a cpu example, or a copy of the model on meta, plans as the cpu
example does.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import ExampleInputError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).relu()


def _lines(gm: nn.Module) -> dict:
    return {name: (p.dtype, str(p.rule), p.reason)
            for name, p in fxamp.plan_of(gm).nodes.items()}


@pytest.mark.parametrize("frontend", ["fx", "export", "auto"])
def test_meta_example_for_cpu_model_is_refused_naming_both_devices(frontend: str) -> None:
    torch.manual_seed(0)
    model = Net()
    with pytest.raises(ExampleInputError) as info:
        fxamp.amp_rewrite(model, (torch.empty(2, 8, device="meta"),),
                          fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                   frontend=frontend))
    text = str(info.value)
    assert "device meta" in text and "on cpu" in text and "Net" in text
    assert "what to do" in text and "copy.deepcopy(model).to('meta')" in text
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model untouched


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_following_the_meta_advice_plans_as_a_cpu_example_does(frontend: str) -> None:
    torch.manual_seed(0)
    model = Net()
    kwargs = dict(dtype=torch.bfloat16, target="cpu", frontend=frontend)
    on_cpu = fxamp.amp_rewrite(model, (torch.randn(2, 8),), fxamp.RewriteConfig.make(**kwargs))
    on_meta = fxamp.amp_rewrite(copy.deepcopy(model).to("meta"),
                                (torch.empty(2, 8, device="meta"),),
                                fxamp.RewriteConfig.make(**kwargs))
    assert _lines(on_meta) == _lines(on_cpu)
    assert all(str(p.rule) == "autocast" and "observed" not in p.reason
               for p in fxamp.plan_of(on_cpu).nodes.values())


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_cpu_example_for_meta_model_is_refused_naming_both_devices(frontend: str) -> None:
    model = Net().to("meta")
    with pytest.raises(ExampleInputError) as info:
        fxamp.amp_rewrite(model, (torch.randn(2, 8),),
                          fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                   frontend=frontend))
    text = str(info.value)
    assert "Net's Parameters or buffers are on device meta" in text and "on cpu" in text
    assert "pass example inputs on meta too" in text
    # the advice, followed: meta inputs plan as a cpu model's cpu example does
    torch.manual_seed(0)
    on_cpu = fxamp.amp_rewrite(Net(), (torch.randn(2, 8),),
                               fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                        frontend=frontend))
    on_meta = fxamp.amp_rewrite(model, (torch.empty(2, 8, device="meta"),),
                                fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                         frontend=frontend))
    assert _lines(on_meta) == _lines(on_cpu)
