"""Performance-related correctness: torch.compile, no_grad/inference_mode, casts per step.

No timings are asserted. Casts are counted with ``fxamp.perf.count_casts`` (the same
TorchDispatchMode as ``benchmarks/casts_per_step.py``).

torch.compile uses ``backend="aot_eager"``: the default (inductor) backend compiles C++
kernels, which takes tens of seconds per graph on the 2-core CI machines; aot_eager still
exercises Dynamo tracing of the rewritten GraphModule (its ``.to`` casts, the functional
F.linear/F.conv2d calls on cast parameters) and AOTAutograd's joint forward/backward graph.
``benchmarks/cpu_step_time.py --compile`` runs the default backend.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.perf import count_casts

DT = torch.bfloat16


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.c1(x)))
        x = F.relu(self.c2(x)) + x
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, Linear QKV, matmul, softmax, MLP."""

    def __init__(self, d: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.h), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _cases():
    torch.manual_seed(0)
    return [("cnn", SmallCNN(), (torch.randn(2, 3, 16, 16),)),
            ("block", Block(), (torch.randn(2, 8, 32),))]


CASES = _cases()
IDS = [c[0] for c in CASES]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name,model,inputs", CASES, ids=IDS)
def test_compiled_gm_matches_eager_gm(name, model, inputs):
    torch._dynamo.reset()
    model = model.eval()  # eval: BatchNorm running stats stay put between the two runs
    gm = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(dtype=DT, target="cpu"))
    want = gm(*inputs)
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    got = compiled(*inputs)
    _close(got, want)
    # and a training step through the compiled module gives the same gradients
    model.train()
    gm.train()
    for p in model.parameters():
        p.grad = None
    gm(*inputs).float().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    compiled(*inputs).float().sum().backward()
    for g, w in zip((p.grad for p in model.parameters()), want_grads):
        _close(g, w)
    torch._dynamo.reset()


@pytest.mark.parametrize("name,model,inputs", CASES, ids=IDS)
@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode],
                         ids=["no_grad", "inference_mode"])
def test_runs_without_grad(name, model, inputs, ctx):
    model = model.eval()
    gm = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(dtype=DT, target="cpu"))
    want = gm(*inputs).detach()
    with ctx():
        got = gm(*inputs)
    assert not got.requires_grad
    _close(got, want)
    with ctx():  # the pure autocast mirror too
        off = fxamp.amp_rewrite(model, inputs,
                                fxamp.RewriteConfig.make(dtype=DT, target="cpu",
                                                         policy="numerics=off"))(*inputs)
        with torch.autocast("cpu", dtype=DT):
            ref = model(*inputs)
    _close(off, ref)


def _backward(out: torch.Tensor) -> None:
    out.float().sum().backward()


@pytest.mark.parametrize("name,model,inputs", CASES, ids=IDS)
def test_casts_per_step_not_above_autocast(name, model, inputs):
    model = model.train()
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(dtype=DT, target="cpu", policy="numerics=off"))

    def autocast_forward():
        with torch.autocast("cpu", dtype=DT):
            return model(*inputs)

    model.zero_grad(set_to_none=True)
    ref = count_casts(autocast_forward, _backward)
    model.zero_grad(set_to_none=True)
    got = count_casts(lambda: gm(*inputs), _backward)
    assert ref.n > 0, "the counter saw no casts under autocast: it is not counting"
    assert got.n <= ref.n, (f"fxamp {got.n} casts vs autocast {ref.n}: "
                            f"{dict(got.by_kind)} vs {dict(ref.by_kind)}")
    assert got.bytes <= ref.bytes


def test_count_casts_counts_to_and_its_backward():
    x = torch.randn(4, 4, requires_grad=True)
    c = count_casts(lambda: x.to(DT), lambda y: y.float().sum().backward())
    # forward: x.to(bf16); "backward" phase (loss + backward): y.float(), then the grad of
    # .float() back to bf16, then ToCopyBackward of x.to to f32
    assert c.phase("forward") == 1
    assert c.by_kind[("_to_copy", "bf16", "f32", "backward")] == 2
    assert c.by_kind[("_to_copy", "f32", "bf16", "backward")] == 1
    assert c.bytes == 16 * (2 + 4 + 4 + 2)
    assert c.n == c.phase("forward") + c.phase("backward")
    assert count_casts(lambda: x.to(torch.float32) + 1).n == 0
