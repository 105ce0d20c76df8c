"""The opt-in range guard (policy ``guard=on``): a plan with ranges warns once, naming the
node and the value, when a call's value passes the limit its FP16 decision depended on."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

import fxamp
from fxamp import runtime


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _rewrite(policy: str) -> nn.Module:
    torch.manual_seed(0)
    return fxamp.amp_rewrite(Net(), (torch.randn(4, 8),),
                             fxamp.RewriteConfig.make(target="tensorrt", policy=policy))


def test_a_deployment_plan_meeting_inputs_past_its_ranges_warns_once_naming_the_node(
        caplog, monkeypatch):
    monkeypatch.setattr(runtime, "_RANGE_WARNED", set())
    gm = _rewrite("guard=on")
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="fxamp.runtime"):
        gm(x)  # like the example: quiet
        assert not caplog.records
        big = gm(x * 1e5)  # non-finite in fp16
        gm(x * 1e5)
    assert not torch.isfinite(big).all() and torch.isfinite(Net()(x * 1e5)).all()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"past {65504 / 128:.4g}" in warned[0], warned
    assert warned[0].startswith("node a reached") or warned[0].startswith("node b reached")


def test_without_the_guard_nothing_is_checked(caplog):
    gm = _rewrite("")
    assert not any(n.target is runtime.range_guard for n in gm.graph.nodes)
    assert "guard=on" in str(fxamp.plan_of(_rewrite("guard=on")).header["policy"])
    with caplog.at_level(logging.WARNING, logger="fxamp.runtime"):
        gm(torch.randn(4, 8) * 1e5)
    assert not caplog.records
