"""``torch.compile`` with its default backend (inductor) on CPU: the compiled rewritten model
against the compiled FP32 model run under ``torch.autocast("cpu", torch.bfloat16)``, a
Linear + LayerNorm + GELU MLP and a small conv net: the loss and every gradient equal bit for
bit. (Compiled code is not eager code: inductor fuses casts into its kernels, so both differ
from their eager runs by up to a bf16 rounding; what fxamp promises is the compiled plan
equal to compiled autocast.) Inductor's CPU code needs a C++ compiler: without one these
tests fail, saying so."""
from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

BF16 = torch.bfloat16
pytestmark = pytest.mark.slow


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean((2, 3)))


def _inputs(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        return torch.randn(4, 16, generator=gen)
    return torch.randn(2, 3, 8, 8, generator=gen)


def _step(model: nn.Module, x: torch.Tensor, autocast: bool):
    y = torch.tensor([0, 1, 2, 3])[: x.shape[0]]
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_a_cpp_compiler_for_inductor_is_installed():
    """Inductor compiles its CPU kernels with a C++ compiler ($CXX, else g++ or clang++ on
    the PATH); without one the compile tests below fail with torch's own error."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    assert any(shutil.which(n) for n in names), (
        f"no C++ compiler for inductor's CPU kernels: none of {names} is on the PATH. what "
        "to do: install one (g++), or set CXX to its path")


@pytest.mark.parametrize("inplace", [False, True], ids=["returned", "inplace"])
@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_inductor_compiled_rewrite_equals_inductor_compiled_autocast_bit_for_bit(name, inplace):
    torch.manual_seed(0)
    ref = MLP() if name == "mlp" else ConvNet()
    x = _inputs(name)
    model = copy.deepcopy(ref)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                           inplace=inplace)
    torch._dynamo.reset()
    got_loss, got_grads = _step(torch.compile(gm, dynamic=False), x, False)
    want_loss, want_grads = _step(torch.compile(ref, dynamic=False), x, True)
    assert torch.equal(got_loss, want_loss), (got_loss, want_loss)
    assert list(got_grads) == list(want_grads)
    differ = {k: (got_grads[k] - want_grads[k]).abs().max().item()
              for k in got_grads if not torch.equal(got_grads[k], want_grads[k])}
    assert not differ, differ
