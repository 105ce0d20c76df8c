"""The front-end registry: one protocol, tried in the order ``frontend=`` asks for."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxamp.config import FRONTEND_ORDER, FRONTENDS
from fxamp.errors import TraceError
from fxamp.frontends import (ATEN, EAGER, FX, PARTIAL, REGISTRY, Children, Traced,
                             capture_model, graph_frontend, trace_model)


class ValueBranchRoot(nn.Module):
    """The root's forward branches on a tensor value (no tracer takes it); its children
    are plain graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            return self.b(h)
        return h


def test_every_ordered_name_is_a_registered_front_end() -> None:
    assert FRONTENDS == tuple(FRONTEND_ORDER)
    assert {name for names in FRONTEND_ORDER.values() for name in names} == set(REGISTRY)
    for fe in REGISTRY.values():
        assert callable(fe.capture) and isinstance(fe.fallback, bool)
        if fe.graph:
            assert all(callable(getattr(fe, m)) for m in
                       ("inputs", "calibration", "runtime_calls", "finish"))
    # the fallbacks come after the front ends whose failures they work around
    assert FRONTEND_ORDER["auto"] == (FX.name, ATEN.name, PARTIAL.name, EAGER.name)


def test_plain_model_is_a_graph_of_the_first_front_end() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    for asked, taken in (("auto", "fx"), ("fx", "fx"), ("export", "export")):
        captured = capture_model(model, (x,), {}, asked)
        assert isinstance(captured, Traced) and captured.kind == "graph"
        assert captured.frontend == taken
        assert graph_frontend(captured) is REGISTRY[taken]
        out = captured.graph_module(*captured.inputs)
        torch.testing.assert_close(out, model(x))


def test_untraceable_root_gives_children_or_one_error_naming_each_front_end() -> None:
    torch.manual_seed(0)
    model = ValueBranchRoot()
    x = torch.randn(2, 4)
    captured = capture_model(model, (x,), {}, "auto")
    assert isinstance(captured, Children) and captured.kind == "children"
    assert captured.frontend == "eager" and captured.paths == ["a", "b"]
    assert set(captured.calls) <= {"a", "b"} and "a" in captured.calls
    args, _, out = captured.calls["a"]
    torch.testing.assert_close(out, model.a(x))
    refused = captured.refused
    assert isinstance(refused, TraceError)
    lines = str(refused).splitlines()
    assert lines[0] == "no front end takes ValueBranchRoot."
    assert [line.split(":")[0] for line in lines if line.startswith("- ")] == ["- fx",
                                                                              "- export"]
    # a caller needing one graph of the whole model gets that error, not children
    with pytest.raises(TraceError, match="no front end takes ValueBranchRoot"):
        trace_model(model, (x,), {}, "auto")
    # one front end asked for: its own error
    with pytest.raises(TraceError, match="torch.fx.symbolic_trace cannot trace") as info:
        capture_model(model, (x,), {}, "fx")
    assert "no front end takes" not in str(info.value)
