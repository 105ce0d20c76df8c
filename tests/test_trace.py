"""Tracing front end: train/eval constants, custom Functions as leaves, clear errors."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from autocast_truth import autocast_rewrite


class MyDrop(nn.Module):
    """Reads self.training inside forward: fx would bake the mode in."""

    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = MyDrop()

    def forward(self, x):
        return self.drop(self.fc(x))


@pytest.mark.parametrize("start_in_train", [True, False])
def test_self_training_constants_follow_train_and_eval(start_in_train):
    model = Net().train(start_in_train)
    x = torch.randn(8, 16)
    gm = autocast_rewrite(model, (x,), dtype=torch.bfloat16, target="cpu")
    assert gm.training == start_in_train
    gm.eval()
    assert torch.equal(gm(x), gm(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(gm(x), model.eval()(x))
    gm.train()
    a, b = gm(x), gm(x)
    assert not torch.equal(a, b)  # dropout is active again
    assert (a == 0).float().mean() > 0.2


class ModeBranch(nn.Module):
    def forward(self, x):
        if self.training:
            return x * 2
        return x.relu()


def test_structural_mode_difference_is_reported(caplog):
    model = nn.Sequential(nn.Linear(4, 4), ModeBranch()).eval()
    with caplog.at_level(logging.INFO, logger="fxamp"):
        gm = autocast_rewrite(model, (torch.randn(2, 4),), dtype=torch.bfloat16, target="cpu")
    assert "traces differently in train and eval mode" in caplog.text
    assert "relu" in gm.code


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return x


def test_untraceable_model_raises_trace_error_naming_the_line():
    with pytest.raises(fxamp.TraceError) as info:  # (frontend="auto" may run it eagerly)
        autocast_rewrite(Untraceable(), (torch.randn(2, 4),), frontend="fx")
    msg = str(info.value)
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "what to do" in msg
    assert isinstance(info.value, fxamp.FxampError)


class DtypeBranchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if x.dtype != torch.float32:  # would break symbolic tracing through forward
            raise TypeError("needs fp32")
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g * 3


class UsesFn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return DtypeBranchFn.apply(self.fc(x).float())


def test_custom_function_is_a_leaf_call_and_backprops():
    model = UsesFn()
    x = torch.randn(2, 4)
    gm = autocast_rewrite(model, (x,), dtype=torch.float16, target="cuda")
    plan = fxamp.plan_of(gm)
    leaf = [p for p in plan.nodes.values() if p.op.endswith("DtypeBranchFn.apply")]
    assert len(leaf) == 1 and leaf[0].rule == "runtime"
    gm(x).sum().backward()
    assert model.fc.weight.grad.dtype == torch.float32
