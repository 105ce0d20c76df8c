"""Every plan fxamp writes re-applies: ``amp_rewrite(model, x, Plan.load(p).policy)``
plans the same dtype for every node as the rewrite that wrote ``p`` (a plain rewrite, a
tolerance search, a healed Trainer)."""
from pathlib import Path
from typing import Dict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.train import Trainer


class Sensitive(nn.Module):
    """An MLP where one spot scales values into fp16's subnormals and back: the plain
    rewrite misses a 5e-3 tolerance, so the search keeps some nodes in FP32."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                x = (x * 1e-6) * 1e6
        return x


def _dtypes(plan: fxamp.Plan) -> Dict[str, torch.dtype]:
    return {name: p.dtype for name, p in plan.nodes.items()}


def _reapplied(model: nn.Module, x: torch.Tensor, plan: fxamp.Plan, tmp_path: Path
               ) -> fxamp.Plan:
    """The plan of a rewrite with the policy of ``plan`` after a save and a load."""
    path = tmp_path / "model.plan"
    plan.save(str(path))
    loaded = fxamp.Plan.load(str(path))
    return fxamp.plan_of(fxamp.amp_rewrite(model, (x,), loaded.policy))


def test_a_plain_rewrites_plan_reapplies_to_the_same_dtypes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Sensitive(), torch.randn(4, 16)
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, (x,),
                                           fxamp.RewriteConfig.make(target="cpu",
                                                                    policy="fp32:tanh_1")))
    assert _dtypes(_reapplied(model, x, plan, tmp_path)) == _dtypes(plan)


def test_a_search_plan_reapplies_to_the_same_dtypes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Sensitive()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    x = data[0][0]
    found = fxamp.search(model, (x,), data, "target=cpu", rtol=5e-3)
    assert found.met and found.fp32_nodes, found
    plan = fxamp.plan_of(found.graph_module)
    again = _reapplied(model, x, plan, tmp_path)
    assert _dtypes(again) == _dtypes(plan)
    for name in found.fp32_nodes:  # the search's nodes, kept by the policy's fp32 items
        assert plan.nodes[name].rule == "search" and again.nodes[name].rule == "user"
    with torch.no_grad():
        gm = fxamp.amp_rewrite(model, (x,), plan.policy)
        assert torch.equal(gm(x), found.graph_module(x))


def test_a_search_result_has_the_config_it_was_made_with() -> None:
    torch.manual_seed(0)
    model = Sensitive()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    found = fxamp.search(model, data[0], data,
                         fxamp.RewriteConfig.make(target="cpu", frontend="fx"), rtol=5e-3)
    config = fxamp.config_of(found.graph_module)
    assert config.frontend == "fx" and str(config.policy) == fxamp.plan_of(
        found.graph_module).policy
    assert {o.pattern for o in config.policy.overrides} == set(found.fp32_nodes)


def test_a_bisection_plan_reapplies_to_the_same_dtypes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Sensitive()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    x = data[0][0]
    found = fxamp.bisect_baseline(model, (x,), data, "target=cpu", rtol=5e-3)
    assert found.met and found.fp32_nodes, found
    plan = fxamp.plan_of(found.graph_module)
    assert _dtypes(_reapplied(model, x, plan, tmp_path)) == _dtypes(plan)
    assert all(plan.nodes[n].rule == "bisect" for n in found.fp32_nodes)


def test_a_healed_trainers_plan_reapplies_to_the_same_dtypes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Sensitive(), torch.randn(4, 16)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(target="cpu"))
    trainer = Trainer(gm, torch.optim.SGD(model.parameters(), lr=0.01), heal=True,
                      heal_after=1, original_model=model, example_inputs=(x,))
    bad = torch.full((4, 16), 6e4)  # overflows fp16 in the first matmul
    result = trainer.step(lambda m, b: F.mse_loss(m(b).float(), torch.zeros(4, 16)), bad)
    assert result.skipped and result.healed, result
    plan = fxamp.plan_of(trainer.gm)
    assert plan.nodes[result.healed].rule == "heal"
    assert _dtypes(_reapplied(model, x, plan, tmp_path)) == _dtypes(plan)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_search_plan_made_with_a_front_end_reapplies_with_it(tmp_path: Path,
                                                                frontend: str) -> None:
    torch.manual_seed(0)
    model = Sensitive()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    x = data[0][0]
    found = fxamp.search(model, (x,), data,
                         fxamp.RewriteConfig.make(target="cpu", frontend=frontend), rtol=5e-3)
    plan = fxamp.plan_of(found.graph_module)
    path = tmp_path / "model.plan"
    plan.save(str(path))
    loaded = fxamp.Plan.load(str(path))
    again = fxamp.amp_rewrite(model, (x,),
                              fxamp.RewriteConfig.make(policy=loaded.policy,
                                                       frontend=loaded.header["frontend"]))
    assert _dtypes(fxamp.plan_of(again)) == _dtypes(plan)
