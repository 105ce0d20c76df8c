"""Tolerance search against the bisection baseline, on a model with a few sensitive nodes."""
import pytest
import torch
import torch.nn as nn

import fxamp

CPU = fxamp.RewriteConfig.make(target="cpu")


class Sensitive(nn.Module):
    """A 12-layer MLP where two spots scale values into fp16's subnormals and back."""

    def __init__(self, depth=12, spots=(5, 9)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))
        self.spots = spots

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i in self.spots:
                x = (x * 1e-6) * 1e6
        return x


def _setup():
    torch.manual_seed(0)
    model = Sensitive()
    data = [(torch.randn(4, 16),) for _ in range(3)]
    return model, (torch.randn(4, 16),), data


@pytest.mark.slow
def test_search_meets_the_tolerance_with_fewer_nodes_and_evaluations_than_bisection():
    model, inputs, data = _setup()
    plain = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(target="cpu"))
    with torch.no_grad():
        plain_err = fxamp.rewriter.search.max_relative_error(
            [plain(*b) for b in data], [model(*b) for b in data])
    found = fxamp.search(model, inputs, data, CPU, rtol=5e-3)
    base = fxamp.bisect_baseline(model, inputs, data, CPU, rtol=5e-3)
    msg = (f"plain error {plain_err:.3g}; search: {len(found.fp32_nodes)} fp32 nodes, "
           f"{found.evaluations} evaluations, error {found.error:.3g}; bisection: "
           f"{len(base.fp32_nodes)} nodes, {base.evaluations} evaluations, error {base.error:.3g}")
    assert plain_err > 5e-3, msg
    assert found.met and base.met and found.error <= 5e-3, msg
    assert len(found.fp32_nodes) < len(base.fp32_nodes), msg
    assert found.evaluations < base.evaluations, msg
    plan = fxamp.plan_of(found.graph_module)
    for name in found.fp32_nodes:
        assert plan.nodes[name].rule == "search" and plan.nodes[name].dtype == torch.float32
        assert "fxamp.search" in plan.nodes[name].reason
    x = data[0][0]
    with torch.no_grad():
        assert ((found.graph_module(x) - model(x)).abs().max() / model(x).abs().max()) <= 5e-3


def test_a_plan_that_already_meets_the_tolerance_costs_one_evaluation():
    torch.manual_seed(0)
    model = Sensitive(spots=())
    data = [(torch.randn(4, 16),)]
    found = fxamp.search(model, data[0], data, CPU, rtol=5e-2)
    assert found.met and found.fp32_nodes == [] and found.evaluations == 1


def test_a_user_metric_drives_the_search():
    model, inputs, data = _setup()
    calls = []

    def top1_disagreement(outputs, references):
        calls.append(1)
        return max(float((o.argmax(-1) != r.argmax(-1)).float().mean())
                   for o, r in zip(outputs, references))

    found = fxamp.search(model, inputs, data, CPU, rtol=0.0,
                         metric=top1_disagreement)
    assert found.met and found.error == 0.0 and len(calls) == found.evaluations - (
        1 if found.fp32_nodes else 0)
