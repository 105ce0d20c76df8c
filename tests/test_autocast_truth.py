"""Tests for the autocast ground-truth helpers in ``autocast_truth``.

Every expected dtype below was checked against real autocast behaviour of
torch 2.14.1 (CPU: real ``torch.autocast("cpu")``; CUDA: the AutocastCUDA
kernels run on fake CUDA tensors) and agrees with the op lists in the
torch.amp documentation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from torch import nn

from autocast_truth import (
    autocast_category_probes,
    has_autocast_kernel,
    observed_category,
    record_autocast_dtypes,
    run_autocast_cpu,
)

pytestmark = pytest.mark.floor  # also run on the oldest supported torch (.ci/run)

LOW = [torch.bfloat16, torch.float16]
TARGETS = ["cpu", "cuda"]


def _cat(name: str, target: str, dtype: torch.dtype) -> str:
    p = autocast_category_probes()[name]
    return observed_category(p.fn, p.make_inputs, target, dtype, mixed=p.mixed)


# --------------------------------------------------------------------------
# op categories
# --------------------------------------------------------------------------

# CUDA autocast (docs "CUDA Ops that can autocast to float16" / "to float32" /
# "promote to the widest input type"; ops in no list run in the input dtype).
CUDA_FACTS = {
    "linear": "lower",
    "matmul": "lower",
    "bmm": "lower",
    "softmax": "fp32",
    "layer_norm": "fp32",
    "exp": "fp32",
    "sum": "fp32",
    "pow": "fp32",
    "mse_loss": "fp32",
    "rdiv": "fp32",  # 1/x -> reciprocal, on the fp32 list
    "relu": "follow",
    "gelu": "follow",
    "addcmul": "promote",
}

# CPU autocast: only matmul-like ops lower; softmax / layer_norm are in no
# list (follow); losses are on the fp32 list; cat is on the promote list.
CPU_FACTS = {
    "linear": "lower",
    "matmul": "lower",
    "softmax": "follow",
    "layer_norm": "follow",
    "exp": "follow",
    "cross_entropy": "fp32",
    "mse_loss": "fp32",
    "cat": "promote",
}


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(CUDA_FACTS))
def test_cuda_categories(name: str, dtype: torch.dtype) -> None:
    assert _cat(name, "cuda", dtype) == CUDA_FACTS[name]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(CPU_FACTS))
def test_cpu_categories(name: str, dtype: torch.dtype) -> None:
    assert _cat(name, "cpu", dtype) == CPU_FACTS[name]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("target", TARGETS)
def test_every_probe_classifies(target: str, dtype: torch.dtype) -> None:
    for name, p in autocast_category_probes().items():
        cat = observed_category(p.fn, p.make_inputs, target, dtype, mixed=p.mixed)
        assert cat in {"lower", "fp32", "follow", "promote"}, (name, cat)


def test_observed_category_plain_callables() -> None:
    # The function works with ad-hoc fn / make_inputs, not only the table.
    x = torch.randn(3, 3)
    assert observed_category(lambda t: t @ t, lambda d: (x.to(d),), "cpu", torch.bfloat16) == "lower"
    assert observed_category(torch.tanh, lambda d: (x.to(d),), "cuda", torch.float16) == "follow"


def test_has_autocast_kernel() -> None:
    assert has_autocast_kernel("aten::linear", "cpu")
    assert has_autocast_kernel("aten::cat", "cpu")
    assert has_autocast_kernel("aten::addcmul", "cuda")
    assert not has_autocast_kernel("aten::add.Tensor", "cuda")
    assert not has_autocast_kernel("aten::layer_norm", "cpu")


def test_fake_cuda_restores_autocast_state() -> None:
    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    _cat("linear", "cuda", torch.bfloat16)
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == before


# --------------------------------------------------------------------------
# whole graphs
# --------------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.emb = nn.Embedding(10, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, ids: torch.Tensor):
        h = self.lin(x)
        h = self.ln(h)
        h = torch.relu(h)
        p = torch.softmax(h, -1)
        e = self.bn(self.emb(ids))
        return p + e, ids.argmax()


def _small() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    m = Small().train()  # BatchNorm in train mode would update running stats
    return m, (torch.randn(4, 8), torch.tensor([1, 2, 3, 9]))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("target", TARGETS)
def test_record_small_model(target: str, dtype: torch.dtype) -> None:
    m, inputs = _small()
    gm = torch.fx.symbolic_trace(m)
    state = copy.deepcopy(m.state_dict())
    got = record_autocast_dtypes(gm, inputs, target, dtype)

    low = dtype
    f32 = torch.float32
    if target == "cuda":
        expected = {
            "x": f32,
            "lin": low,  # linear: lower-precision list
            "ln": f32,  # layer_norm: fp32 list on CUDA
            "relu": f32,  # not in any list: follows its fp32 input
            "softmax": f32,  # softmax: fp32 list on CUDA
            "emb": f32,  # embedding: no list, fp32 weight
            "bn": f32,  # batch_norm: no list, fp32 input
            "add": f32,
        }
    else:
        expected = {
            "x": f32,
            "lin": low,  # linear: lower-precision list on CPU
            "ln": low,  # layer_norm: no CPU list, low input + fp32 params -> low
            "relu": low,  # follows
            "softmax": low,  # softmax: no CPU list, follows
            "emb": f32,
            "bn": f32,
            "add": f32,  # low + fp32 -> ordinary type promotion
        }
    assert got == expected  # ids / argmax (integer) are not recorded

    # The user's model is untouched (parameters and BatchNorm running stats).
    after = m.state_dict()
    assert after.keys() == state.keys()
    for k in state:
        assert torch.equal(after[k], state[k]), k
    assert int(m.bn.num_batches_tracked) == 0
    assert all(p.device.type == "cpu" and p.dtype == f32 for p in m.parameters())
    assert all(p.device.type == "cpu" for p in gm.parameters())
    assert m.training


def test_record_tuple_outputs_and_constants() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = torch.full((4,), 2.0)  # plain tensor attribute (get_attr)

        def forward(self, x: torch.Tensor):
            vals, idx = torch.max(self.lin(x), -1)  # tuple result (values, indices)
            parts = torch.split(x * self.scale, 2, -1)  # tuple of floats
            return vals, idx, parts[0]

    gm = torch.fx.symbolic_trace(M())
    x = torch.randn(3, 4)
    for target in TARGETS:
        got = record_autocast_dtypes(gm, (x,), target, torch.float16)
        assert got["max_1"] == torch.float16  # values of max over a lowered linear
        assert got["scale"] == torch.float32
        assert got["split"] == torch.float32
        assert "getitem_1" not in got  # indices are integer


def test_run_autocast_cpu() -> None:
    m, inputs = _small()
    state = copy.deepcopy(m.state_dict())
    out, idx = run_autocast_cpu(m, inputs, torch.bfloat16)
    assert out.dtype == torch.float32 and idx.dtype == torch.int64
    lin_out = run_autocast_cpu(m.lin, (inputs[0],), torch.bfloat16)
    assert lin_out.dtype == torch.bfloat16
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k
