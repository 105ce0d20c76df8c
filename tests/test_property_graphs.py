"""Property tests: random small models built from ops of every autocast category.

A generated model starts from one or two ``(B, D)`` FP32 inputs, casts each to a random dtype
(fp32 / fp16 / bf16) and then runs a random sequence of steps over a growing pool of
``(B, D)`` tensors: linear, matmul (a parameter, or two pool values), softmax (with or without
``dtype=``), exp (after tanh, so it stays bounded), layer_norm (module or functional),
``sum(keepdim=True)``, relu, add, multiply by a constant, cat on the last dim followed by a
linear back to width D, addcmul, einsum (a contraction, so it runs bmm), an integer side
path (argmax -> embedding) and a boolean mask path (compare -> masked_fill). It returns the
last two pool values. Where autocast itself refuses a generated model (its promote kernels
accept only fp32 and the autocast dtype, so e.g. cat of an fp16 and a bf16 value under bf16
autocast raises), only the rewrite and its run are checked.

Properties, for targets cpu/bf16, cpu/fp16 and cuda/fp16 (CUDA: fake CUDA tensors):

* ``amp_rewrite`` never crashes and the rewritten graph passes ``graph.lint()``;
* every planned dtype equals the dtype ``torch.autocast`` really gives the node;
* on CPU the rewritten model's outputs equal the autocast outputs exactly. The tolerance is
  zero on purpose: the rewritten graph applies the very casts autocast applies and then calls
  the same kernels, so the results are bit-identical (see test_models_handwritten.py); and an
  argmax -> embedding path turns any rounding difference into an O(1) difference, so a loose
  tolerance would not be meaningful;
* with the policy ``fp32:*`` the output is bit-identical (``torch.equal``) to the FP32 model
  (the same model with every input cast being to fp32).
"""
from __future__ import annotations

import copy
from typing import List, Tuple

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxamp
from autocast_truth import record_autocast_dtypes, run_autocast_cpu, autocast_rewrite

B, D = 3, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CONFIGS = [("cpu", torch.bfloat16), ("cpu", torch.float16), ("cuda", torch.float16)]
pytestmark = pytest.mark.slow  # hypothesis: hundreds of random graphs
OPS = ["linear", "matmul_param", "matmul_pool", "softmax", "softmax_dtype", "exp",
       "layer_norm", "F_layer_norm", "sum_keepdim", "relu", "add", "mul_const",
       "cat_linear", "addcmul", "argmax_embedding", "masked_fill", "einsum"]

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


class Program(nn.Module):
    """A straight-line model interpreting ``steps`` over a pool of (B, D) tensors."""

    def __init__(self, n_inputs: int, casts: List[torch.dtype], steps: List[tuple]) -> None:
        super().__init__()
        self.n_inputs, self.casts, self.steps = n_inputs, list(casts), list(steps)
        self.mods = nn.ModuleList()
        self.params = nn.ParameterList()
        for op, *_ in steps:
            if op == "linear":
                self.mods.append(nn.Linear(D, D))
            elif op == "cat_linear":
                self.mods.append(nn.Linear(2 * D, D))
            elif op in ("layer_norm",):
                self.mods.append(nn.LayerNorm(D))
            elif op == "argmax_embedding":
                self.mods.append(nn.Embedding(D, D))
            elif op == "matmul_param":
                self.params.append(nn.Parameter(torch.randn(D, D) / D ** 0.5))

    def forward(self, x, y):  # y is unused when n_inputs == 1
        xs = (x, y)[:self.n_inputs]
        pool = [v.to(dtype) if dtype != torch.float32 else v
                for v, dtype in zip(xs, self.casts)]
        mods, params = iter(self.mods), iter(self.params)
        for op, i, j, k, c in self.steps:
            a, b, d = pool[i % len(pool)], pool[j % len(pool)], pool[k % len(pool)]
            if op == "linear":
                y = next(mods)(a)
            elif op == "matmul_param":
                y = torch.tanh(a @ next(params))
            elif op == "matmul_pool":
                y = torch.matmul(a.unsqueeze(-1), b.unsqueeze(-2)).mean(-1)
            elif op == "softmax":
                y = torch.softmax(a, -1)
            elif op == "softmax_dtype":
                y = F.softmax(a, dim=-1, dtype=torch.float32)
            elif op == "exp":
                y = torch.exp(torch.tanh(a))
            elif op == "layer_norm":
                y = next(mods)(a)
            elif op == "F_layer_norm":
                y = F.layer_norm(a, (D,))
            elif op == "sum_keepdim":
                y = a * torch.tanh(a.sum(-1, keepdim=True))
            elif op == "relu":
                y = torch.relu(a)
            elif op == "add":
                y = a + b
            elif op == "mul_const":
                y = a * c
            elif op == "cat_linear":
                y = next(mods)(torch.cat([a, b], dim=-1))
            elif op == "addcmul":
                y = torch.addcmul(a, torch.tanh(b), torch.tanh(d), value=c)
            elif op == "argmax_embedding":
                y = next(mods)(a.argmax(-1)) + b
            elif op == "einsum":  # contracts over c: runs bmm (lowered on CPU too)
                y = torch.einsum("bi,ci,cj->bj", a, b, d) / B
            elif op == "masked_fill":
                y = a.masked_fill(b > 0, 0.0)
            else:  # pragma: no cover
                raise AssertionError(op)
            pool.append(y)
        return pool[-1], pool[max(len(pool) - 2, 0)]


@st.composite
def programs(draw) -> Tuple[Program, tuple, Program]:
    """(model, example inputs, the same model with every input cast being to fp32)."""
    n_inputs = draw(st.integers(1, 2))
    casts = draw(st.lists(st.sampled_from(DTYPES), min_size=n_inputs, max_size=n_inputs))
    # a prefix of a random permutation (every op gets its turn across examples) plus a few
    # repeats, each reading random earlier pool values
    n_ops = draw(st.integers(1, 7))
    ops = draw(st.permutations(OPS))[:n_ops] + draw(st.lists(st.sampled_from(OPS), max_size=2))
    index = st.integers(0, 16)
    steps = [(op, draw(index), draw(index), draw(index), draw(st.sampled_from([0.5, -1.25, 2.0])))
             for op in ops]
    seed = draw(st.integers(0, 2 ** 16))
    torch.manual_seed(seed)
    model = Program(n_inputs, casts, steps).train(False)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = tuple(torch.randn(B, D, generator=gen) for _ in range(2))
    fp32 = copy.deepcopy(model)
    fp32.casts = [torch.float32] * n_inputs
    return model, inputs, fp32


def _truth(model: nn.Module, inputs: tuple, target: str, dtype: torch.dtype):
    """Autocast's dtype per node, or None where autocast itself refuses the model."""
    try:
        return record_autocast_dtypes(fx.symbolic_trace(copy.deepcopy(model)), inputs, target,
                                      dtype)
    except RuntimeError as err:
        return _refused(err)


def _refused(err: RuntimeError) -> None:
    # autocast's promote kernels (cat/stack on CPU, addcmul on CUDA) accept only fp32 and the
    # autocast dtype: an fp16 value under bf16 autocast (or the reverse) makes them raise.
    # fxamp promotes such inputs to fp32 instead; there is no autocast truth to compare with.
    if "Unexpected floating ScalarType in at::autocast::prioritize" not in str(err):
        raise err
    return None


@SETTINGS
@given(programs())
def test_rewrite_never_crashes_lints_and_plans_like_autocast(program):
    model, inputs, _ = program
    for target, dtype in CONFIGS:
        gm = autocast_rewrite(model, inputs, dtype=dtype, target=target)
        gm.graph.lint()
        plan = fxamp.plan_of(gm)
        with torch.no_grad():
            gm(*inputs)  # runs, on real CPU tensors, whatever the target
        truth = _truth(model, inputs, target, dtype)
        if truth is None:
            continue
        planned = {n: p.dtype for n, p in plan.nodes.items()}
        wrong = {n: (planned.get(n), d) for n, d in truth.items() if planned.get(n) != d}
        assert not wrong, f"{target}/{dtype}: node: (planned, autocast): {wrong}"
        assert set(planned) == set(truth)
        assert all(p.rule == "autocast" for p in plan.nodes.values())


@SETTINGS
@given(programs())
def test_cpu_output_equals_autocast(program):
    model, inputs, _ = program
    for dtype in (torch.bfloat16, torch.float16):
        gm = autocast_rewrite(model, inputs, dtype=dtype, target="cpu")
        with torch.no_grad():
            out = gm(*inputs)
        try:
            ref = run_autocast_cpu(model, inputs, dtype)
        except RuntimeError as err:
            _refused(err)
            continue
        assert len(out) == len(ref) == 2
        for o, r in zip(out, ref):
            assert o.dtype == r.dtype
            assert torch.isfinite(r.float()).all()  # the generator keeps values bounded
            torch.testing.assert_close(o, r, rtol=0, atol=0)


@SETTINGS
@given(programs())
def test_all_fp32_policy_is_bit_identical_to_the_fp32_model(program):
    _, inputs, model = program
    with torch.no_grad():
        ref = model(*inputs)
    for target, dtype in CONFIGS:
        gm = autocast_rewrite(model, inputs, dtype=dtype, target=target, policy="fp32:*")
        gm.graph.lint()
        assert all(p.dtype == torch.float32 for p in fxamp.plan_of(gm).nodes.values())
        with torch.no_grad():
            out = gm(*inputs)
        assert isinstance(out, tuple) and isinstance(ref, tuple)
        assert len(out) == len(ref) == 2  # Program returns the last two pool values
        for o, r in zip(out, ref):
            assert o.dtype == r.dtype == torch.float32
            assert torch.equal(o, r)
