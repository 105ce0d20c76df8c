"""RewriteConfig: made once by amp_rewrite, stored on the result, reused by the trainer's
healing, the tolerance search, the audit and the CLI (front end and calibration included)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.config import RewriteConfig
from fxamp.result import config_of
from fxamp.train import Trainer


class ShapeBranchMLP(nn.Module):
    """torch.fx cannot trace the branch on a shape (a Proxy in ``if``); torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 16:
            x = x * 1.0
        h = self.fc1(x)
        return self.fc2(torch.relu(h * 100.0))  # large values: the ranges pass has work


def test_amp_rewrite_stores_the_config_it_made_once() -> None:
    torch.manual_seed(0)
    model = ShapeBranchMLP()
    x = torch.randn(4, 16)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(target="cpu", policy="fp32:fc2",
                                                    frontend="export"))
    config = config_of(gm)
    assert config.frontend == "export" and str(config.policy) == fxamp.plan_of(gm).policy
    again = fxamp.amp_rewrite(model, (x,), config=config)
    assert fxamp.plan_of(again).to_text() == fxamp.plan_of(gm).to_text()
    with pytest.raises(fxamp.FxampError, match="either config= or"):
        fxamp.amp_rewrite(model, (x,), config=config, frontend="fx")
    with pytest.raises(fxamp.FxampError, match="unknown frontend 'jit'"):
        RewriteConfig.make(frontend="jit")
    with pytest.raises(fxamp.FxampError, match="not made by fxamp.amp_rewrite"):
        config_of(model)


def test_healing_keeps_the_front_end_and_the_calibration() -> None:
    torch.manual_seed(0)
    model = ShapeBranchMLP()
    example = (torch.randn(4, 16),)
    calibration = [(torch.randn(8, 16) * 1000,) for _ in range(2)]  # iterated once only
    gm = fxamp.amp_rewrite(model, example,
                           fxamp.RewriteConfig.make(target="cpu", frontend="export",
                                                    calibration_data=iter(calibration)))
    plan = fxamp.plan_of(gm)
    assert plan.header["frontend"] == "export" and plan.ranges
    kept = {n for n, p in plan.nodes.items() if p.rule == "ranges"}
    assert kept, plan.to_text()
    assert config_of(gm).calibration == plan.ranges  # the ranges, not the spent iterator
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(gm, opt, heal=True, heal_after=1, original_model=model,
                      example_inputs=example)
    bad = torch.full((4, 16), 6e4)  # overflows fp16 in the first matmul

    def loss_fn(m, x):
        return F.mse_loss(m(x).float(), torch.zeros(4, 4))

    result = trainer.step(loss_fn, bad)
    assert result.skipped and result.healed, result
    healed = fxamp.plan_of(trainer.gm)
    assert healed.header["frontend"] == "export"  # healing with policy= alone would be fx
    assert healed.ranges == plan.ranges
    # fc2's matmul ("linear_1") computes in fp16 by autocast's lists; only the calibration
    # ranges (its outputs pass fp16's max) keep it in fp32, before and after healing
    assert "linear_1" in kept and result.healed != "linear_1"
    assert healed.nodes["linear_1"].rule == "ranges"
    assert healed.nodes["linear_1"].dtype == torch.float32
    assert healed.nodes[result.healed].rule == "heal"
    assert config_of(trainer.gm).frontend == "export"


class SensitiveBranch(nn.Module):
    """The search test's sensitive MLP with a shape branch fx cannot trace."""

    def __init__(self, depth: int = 8, spots=(3, 6)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))
        self.spots = spots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 0:
            x = x + 0.0
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i in self.spots:
                x = (x * 1e-6) * 1e6
        return x


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_search_scores_on_the_front_end_the_rewrite_used(frontend: str) -> None:
    torch.manual_seed(0)
    model = SensitiveBranch()
    data = [(torch.randn(4, 16),) for _ in range(2)]
    with pytest.raises(fxamp.TraceError):
        fxamp.amp_rewrite(model, data[0], fxamp.RewriteConfig.make(target="cpu", frontend="fx"))
    found = fxamp.search(model, data[0], data,
                         RewriteConfig.make(target="cpu", frontend=frontend), rtol=5e-3)
    plan = fxamp.plan_of(found.graph_module)
    assert plan.header["frontend"] == "export"
    assert found.met and found.fp32_nodes, found
    assert all(plan.nodes[n].rule == "search" for n in found.fp32_nodes)
    # the scores came from the exported graph: the chosen nodes are ATen nodes of it
    scores = fxamp.rewriter.search.local_errors(
        model, data, found.fp32_nodes, torch.float16, frontend)
    assert set(scores) == set(found.fp32_nodes) and max(scores.values()) > 0


def test_audit_and_cli_take_the_config(tmp_path) -> None:
    torch.manual_seed(0)
    model = ShapeBranchMLP()
    x = torch.randn(4, 16)
    # the exported graph's names: fc2's matmul is "linear_1" (out_features 4 in fp16)
    findings = fxamp.audit(model, (x,), config=RewriteConfig.make(None, None, "cpu", "export"))
    assert [(f.code, f.node) for f in findings] == [("dims-not-multiple-of-8", "linear_1")]
    kept = RewriteConfig.make("fp32:linear_1", None, "cpu", "export")
    assert fxamp.audit(model, (x,), config=kept) == []  # the override reached the rewrite
    with pytest.raises(fxamp.TraceError):
        fxamp.audit(model, (x,), RewriteConfig.make(target="cpu", frontend="fx"))  # (it too)
    # the CLI builds one config from --policy/--dtype/--target/--frontend for every command
    factory = tmp_path / "config_shape_branch.py"  # a module name no other test uses
    factory.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(16, 4)\n\n"
        "    def forward(self, x):\n        if x.shape[-1] == 16:\n            x = x * 1.0\n"
        "        return self.fc(x)\n\n\ndef build():\n"
        "    return M(), (torch.randn(2, 16),)\n")
    from fxamp.cli import main

    assert main(["audit", f"{factory}:build", "--target", "cpu", "--frontend", "export"]) == 0
    assert main(["audit", f"{factory}:build", "--target", "cpu", "--frontend", "fx"]) == 2
