"""Autocast as the oracle (passes/observe.py) and its use in annotate.

Each case is one where a hand-written table of autocast could be (or was) wrong; the truth
is real ``torch.autocast`` on real tensors (CPU) or the AutocastCUDA kernels on fake CUDA
tensors (tests/autocast_truth.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

import fxamp
from fxamp.passes.observe import observe
from autocast_truth import record_autocast_dtypes


def _call(fn):
    return lambda a, k, p, b: fn(*a, **k)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_observe_sees_autocast_casts_and_outputs(target):
    with FakeTensorMode():
        x, w = torch.empty(4, 8), torch.empty(3, 8)
        lin = observe(_call(F.linear), (x, w), {}, {}, {}, target, torch.float16)
        mse = observe(_call(torch._C._nn.mse_loss), (x.half(), x.half()), {}, {}, {}, target,
                      torch.float16)
        f64 = observe(_call(F.linear), (x.double(), w.double()), {}, {}, {}, target,
                      torch.float16)
    assert lin.casts == {0: torch.float16, 1: torch.float16}
    assert lin.outputs == (torch.float16,)
    assert mse.casts == {0: torch.float32, 1: torch.float32}
    assert mse.outputs == (torch.float32,)
    assert f64.casts == {} and f64.outputs == (torch.float64,)


def test_observe_reports_autocast_refusal_on_cuda_only():
    with FakeTensorMode():
        p, t = torch.empty(4), torch.empty(4)
        cuda = observe(_call(torch._C._nn.binary_cross_entropy), (p, t), {}, {}, {}, "cuda",
                       torch.float16)
        cpu = observe(_call(torch._C._nn.binary_cross_entropy), (p, t), {}, {}, {}, "cpu",
                      torch.bfloat16)
    assert cuda.banned and "binary_cross_entropy" in cuda.message
    assert not cpu.banned and cpu.outputs == (torch.float32,)


class _Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a, b):
        return self.fn(a, b)


def test_torch_C_nn_spelling_is_decided_by_observation_and_bit_identical():
    """``torch._C._nn.mse_loss`` is on no table under that spelling: autocast's observed
    fp32 casts decide, and the rewritten model equals autocast bit for bit."""
    m = _Call(lambda a, b: torch._C._nn.mse_loss(a, b))
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    gm = fxamp.amp_rewrite(m, (a, b),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                    frontend="fx",
                                                    policy="numerics=off"))
    p = fxamp.plan_of(gm).nodes["mse_loss"]
    assert (p.dtype, p.inputs) == (torch.float32, torch.float32)
    assert "observed" in p.reason and "on no autocast list" in p.reason
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = m(a, b)
    assert torch.equal(gm(a, b), ref)


def test_casts_inside_the_call_run_under_autocast_at_run_time():
    """CUDA autocast runs cross_entropy's log_softmax in fp16 and casts only its result to
    fp32 for nll_loss: no cast of the inputs reproduces that, so the call runs under autocast
    (``runtime``) — on CPU (bf16), where the tables agree, it stays an input cast."""
    m = _Call(lambda a, t: F.cross_entropy(a, t))
    a, t = torch.randn(4, 8).half(), torch.randint(0, 8, (4,))
    gm = fxamp.amp_rewrite(m, (a, t),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda",
                                                    frontend="fx",
                                                    policy="numerics=off"))
    p = fxamp.plan_of(gm).nodes["cross_entropy"]
    assert p.rule == "runtime" and "observed" in p.reason
    truth = record_autocast_dtypes(torch.fx.symbolic_trace(m), (a, t), "cuda", torch.float16)
    assert p.dtype == truth["cross_entropy"]


def test_float64_model_stays_float64():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).double()
    x = torch.randn(2, 8, dtype=torch.float64)
    for target in ("cpu", "cuda"):
        gm = fxamp.amp_rewrite(m, (x,),
                               fxamp.RewriteConfig.make(dtype=torch.float16, target=target))
        plan = fxamp.plan_of(gm)
        assert {p.dtype for p in plan.nodes.values()} == {torch.float64}
        assert all(p.inputs is None for p in plan.nodes.values())
        assert torch.equal(gm(x), m(x))


def test_norm_probe_does_not_touch_a_meta_model():
    """The norm eps probe runs on CPU stand-ins, not on (a deepcopy of) the model's tensors:
    a model on meta with a tiny-eps InstanceNorm is still probed and fenced in fp32."""
    m = nn.Sequential(nn.Conv2d(2, 4, 1), nn.InstanceNorm2d(4, eps=1e-12))
    plans = {}
    for device in ("cpu", "meta"):
        x = torch.randn(1, 2, 4, 4).to(device)
        gm = fxamp.amp_rewrite(m.to(device), (x,),
                               fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda"))
        plans[device] = {k: (p.dtype, p.rule) for k, p in fxamp.plan_of(gm).nodes.items()}
        assert next(gm.parameters()).device.type == device
    assert plans["meta"] == plans["cpu"]
    assert plans["cpu"]["_1"] == (torch.float32, "norm_eps")
