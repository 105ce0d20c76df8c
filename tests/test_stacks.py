"""fxamp's cheaper stack-trace capture gives the text torch.fx's own capture gives."""
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from fxamp.frontends import stacks
from fxamp.frontends.fx import FxampTracer, _functions_as_leaves, trace


class _FxCapture(FxampTracer):
    """FxampTracer with torch.fx's own stack-trace capture."""

    create_node = fx.Tracer.create_node


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _helper(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) + 1


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x)
        for _ in range(4):  # the same source lines repeat (the cache must not mix them up)
            h = _helper(h)
        return F.softmax(_Scale.apply(h), dim=-1)


def _traces(tracer_cls, model):
    with _functions_as_leaves():
        graph = tracer_cls().trace(model)
    return [(n.name, n.stack_trace) for n in graph.nodes]


def test_stack_traces_equal_fx_capture():
    assert stacks.supported(FxampTracer())
    for model in (Nested(), torchvision.models.resnet18()):
        ours, theirs = _traces(FxampTracer, model), _traces(_FxCapture, model)
        assert ours == theirs
        assert sum(t is not None for _, t in ours) >= len(ours) - 2  # placeholder, output
    gm = trace(Nested())
    helper = [n for n in gm.graph.nodes if n.target is torch.tanh]
    assert len(helper) == 4 and "in _helper" in helper[0].stack_trace
    assert "h = _helper(h)" in helper[0].stack_trace


def test_forward_only_mode_falls_back_to_fx():
    class ForwardOnly(FxampTracer):
        _record_forward_stack_traces_only = True

    class ForwardOnlyFx(ForwardOnly):
        create_node = fx.Tracer.create_node

    assert not stacks.supported(ForwardOnly())
    assert _traces(ForwardOnly, Nested()) == _traces(ForwardOnlyFx, Nested())
