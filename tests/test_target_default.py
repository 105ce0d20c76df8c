"""The default ``target``: the device the model is on, and one warning for a plan run on the
other device.

Without ``target=`` (and without ``target=`` in the policy) a plan mirrors the autocast of
the device the model is on when it is planned: its first floating Parameter or buffer, else
the example inputs; ``meta`` plans for CUDA. The target used is recorded in the plan header
and ``config_of``. CPU and CUDA autocast have different lists (``layer_norm``: FP32 on CUDA,
bf16 on the CPU), so a plan for one run on the other gives numbers that are neither's
autocast: its first call logs one warning naming both and what to do.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import FxampError

BF16 = torch.bfloat16
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
WARNING = "whose autocast lists differ"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.lin(x)).relu())


class Gram(nn.Module):
    """No Parameters or buffers: its device is its input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ x.t()).softmax(-1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _policy(gm: nn.Module) -> str:
    return fxamp.plan_of(gm).header["policy"]


def test_a_cpu_model_without_target_is_planned_for_cpu_autocast():
    gm = fxamp.amp_rewrite(_net(), (X,), fxamp.RewriteConfig.make(dtype=BF16))
    assert _policy(gm) == "compute=bf16,target=cpu"
    assert fxamp.config_of(gm).policy.target == "cpu"
    explicit = fxamp.amp_rewrite(_net(), (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    assert fxamp.diff(fxamp.plan_of(gm), fxamp.plan_of(explicit)) == ""
    # its numbers are CPU autocast's: the output and every gradient bit for bit
    model, ref = _net(), _net()
    out = fxamp.amp_rewrite(
        model, (X,), fxamp.RewriteConfig.make(dtype=BF16, policy="output=keep"))(X)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(X)
    assert torch.equal(out, want)
    out.float().square().sum().backward()
    want.float().square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def test_the_layer_norm_is_where_cpu_and_cuda_plans_differ():
    cpu = fxamp.plan_of(fxamp.amp_rewrite(_net(), (X,), fxamp.RewriteConfig.make(dtype=BF16)))
    cuda = fxamp.plan_of(fxamp.amp_rewrite(_net(), (X,),
                                           fxamp.RewriteConfig.make(dtype=BF16, target="cuda")))
    norm = next(n for n, p in cpu.nodes.items() if p.module == "norm")
    assert cpu.nodes[norm].dtype is BF16 and cuda.nodes[norm].dtype is torch.float32


def test_a_meta_model_is_planned_for_cuda():
    model = copy.deepcopy(_net()).to("meta")
    gm = fxamp.amp_rewrite(model, (X.to("meta"),), fxamp.RewriteConfig.make(dtype=BF16))
    assert _policy(gm) == "compute=bf16,target=cuda"


def test_a_model_without_parameters_follows_its_example_inputs():
    gm = fxamp.amp_rewrite(Gram(), (X,), fxamp.RewriteConfig.make(dtype=BF16))
    assert _policy(gm) == "compute=bf16,target=cpu"
    meta = fxamp.amp_rewrite(Gram(), (X.to("meta"),), fxamp.RewriteConfig.make(dtype=BF16))
    assert _policy(meta) == "compute=bf16,target=cuda"


def test_an_explicit_target_or_a_policy_target_wins_over_the_device():
    assert _policy(fxamp.amp_rewrite(_net(), (X,),
                                     fxamp.RewriteConfig.make(dtype=BF16, target="cuda"))) == \
        "compute=bf16,target=cuda"
    assert _policy(fxamp.amp_rewrite(_net(), (X,), "compute=bf16,target=cuda")) == \
        "compute=bf16,target=cuda"
    assert _policy(fxamp.amp_rewrite(
        _net(), (X,), fxamp.RewriteConfig.make(target="cpu", policy="compute=bf16,target=cuda"))) == \
        "compute=bf16,target=cuda"
    given = fxamp.Policy(compute=BF16, target="cuda")
    assert _policy(fxamp.amp_rewrite(_net(), (X,), given)) == "compute=bf16,target=cuda"


def test_the_stored_config_holds_the_resolved_target_and_rewrites_the_same():
    model = _net()
    gm = fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16))
    config = fxamp.config_of(gm)
    assert config.policy.target == "cpu" and not config.follow_device
    again = fxamp.amp_rewrite(_net(), (X,), config=config)
    assert fxamp.diff(fxamp.plan_of(gm), fxamp.plan_of(again)) == ""
    # a meta model rewritten with that config keeps the config's target
    meta = fxamp.amp_rewrite(copy.deepcopy(_net()).to("meta"), (X.to("meta"),), config=config)
    assert _policy(meta) == "compute=bf16,target=cpu"
    with pytest.raises(FxampError, match="either config= or the keyword"):
        fxamp.amp_rewrite(_net(), (X,), config=config, target="cpu")


def test_an_inplace_rewrite_without_example_follows_the_device_of_its_first_call():
    model = copy.deepcopy(_net()).to("meta")  # rewritten before it is moved (as a Trainer does)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16), inplace=True)
    assert fxamp.config_of(model).follow_device
    model.to_empty(device="cpu")
    model.load_state_dict(_net().state_dict())
    model(X)
    assert _policy(model) == "compute=bf16,target=cpu"
    assert fxamp.config_of(model).policy.target == "cpu"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.lin(x))


class Stack(nn.Module):
    """Repeated blocks: an in-place rewrite without example plans each block on its call."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_blocks_without_target_follow_the_device_and_a_cuda_plan_warns_per_plan(caplog):
    torch.manual_seed(0)
    model = Stack()
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16), inplace=True)
        model(X)
        model(X)
    assert _policy(model) == "compute=bf16,target=cpu" and WARNING not in caplog.text
    assert fxamp.plan_of(model).nodes["blocks.0/norm"].dtype is BF16  # CPU autocast's lists
    caplog.clear()
    cuda = Stack()
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        fxamp.amp_rewrite(cuda, config=fxamp.RewriteConfig.make(dtype=BF16, target="cuda"),
                          inplace=True)
        cuda(X)
        cuda(X)
    # once per plan object, not per block: the first block's plan and the one the blocks
    # identical to it share
    assert 1 <= caplog.text.count(WARNING) < len(cuda.blocks)


def test_search_without_target_follows_the_model():
    result = fxamp.search(_net(), (X,), [(X,)], fxamp.RewriteConfig.make(dtype=BF16), rtol=10.0)
    assert _policy(result.graph_module) == "compute=bf16,target=cpu"


def test_a_cuda_plan_called_on_the_cpu_warns_once_naming_both(caplog):
    gm = fxamp.amp_rewrite(_net(), (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cuda"))
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        gm(X)
        gm(X)
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1
    assert "target=cuda" in warned[0] and "runs on cpu" in warned[0]
    assert "rewrite it with target='cpu'" in warned[0]


def test_following_the_warning_s_advice_silences_it(caplog):
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        fxamp.amp_rewrite(_net(), (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))(X)
        # the default: the model's device
        fxamp.amp_rewrite(_net(), (X,), fxamp.RewriteConfig.make(dtype=BF16))(X)
    assert WARNING not in caplog.text


def test_an_inplace_cuda_plan_on_the_cpu_warns_once(caplog):
    model = _net()
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cuda"),
                      inplace=True)
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        model(X)
        model(X)
    assert caplog.text.count(WARNING) == 1


def test_a_deployment_plan_run_on_the_cpu_does_not_warn(caplog):
    gm = fxamp.amp_rewrite(_net(), (X,), fxamp.RewriteConfig.make(target="tensorrt"))
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        gm(X)
    assert WARNING not in caplog.text
