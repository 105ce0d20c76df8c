"""torch.func and forward-mode AD through a rewritten attention model equal the FP32 model's
under ``torch.autocast``, bit for bit: ``func.grad`` of the parameters (``functional_call``),
``jacrev`` of the input, per-sample gradients (``vmap(grad)``), ``func.jvp`` and
``torch.autograd.forward_ad`` dual numbers. The q/k/v projections read one cast input, so
the graph fans that cast out through ``runtime.fan_out`` (an ``autograd.Function``)."""
from __future__ import annotations

import copy
import math
from typing import Callable, Dict

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, jvp, vmap

import fxamp
from fxamp import runtime
from fxamp._torch import tree_leaves

BF16 = torch.bfloat16
D, T, CLASSES, BATCH = 16, 5, 4, 3


class Attention(nn.Module):
    """One self-attention block and a head. ``pos``: q/k/v read ``x`` plus a learned position
    table (a non-leaf FP32 activation); without it they read the input ``x`` itself (a leaf
    when differentiated)."""

    def __init__(self, pos: bool = True) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(T, D) * 0.1) if pos else None
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.out, self.norm, self.head = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.pos is None else x + self.pos
        q, k, v = self.q(h), self.k(h), self.v(h)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1) @ v
        return self.head(self.norm(h + self.out(a))).mean(dim=-2)


def _data():
    torch.manual_seed(0)
    return torch.randn(BATCH, T, D), torch.randint(0, CLASSES, (BATCH,)), torch.randn(BATCH, T, D)


def _pair(pos: bool = True, **kwargs):
    """The FP32 model and its rewrite, which fans the q/k/v input cast out."""
    torch.manual_seed(1)
    model = Attention(pos)
    x = _data()[0]
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", **kwargs))
    assert sum(n.target is runtime.fan_out for n in gm.graph.nodes) == 3, gm.code
    return model, gm


def _autocast(fn: Callable) -> Callable:
    """``fn`` called under ``torch.autocast("cpu", bfloat16)``."""

    def call(*args):
        with torch.autocast("cpu", dtype=BF16):
            return fn(*args)
    return call


def _params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def _loss(module: nn.Module) -> Callable:
    def loss(params, x, y):
        return F.cross_entropy(functional_call(module, params, (x,)).float(), y)
    return loss


def _assert_equal(got, want, outputs: bool = False) -> None:
    """Equal tensors, bit for bit and dtype for dtype. ``outputs``: the model's outputs and
    their tangents, which the rewrite returns in FP32 (the policy's output dtype) where
    autocast returns the head's bf16: the same values, upcast exactly."""
    got, want = tree_leaves(got), tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if outputs and w.dtype == BF16:
            assert g.dtype == torch.float32
            w = w.float()
        assert g.dtype == w.dtype and torch.equal(g, w), (g - w).abs().max()


def test_func_grad_of_the_parameters_equals_autocast():
    model, gm = _pair()
    x, y, _ = _data()
    params = _params(model)
    _assert_equal(grad(_loss(gm))(params, x, y), grad(_autocast(_loss(model)))(params, x, y))


@pytest.mark.parametrize("pos", [True, False], ids=["activation", "input"])
def test_jacrev_of_the_input_equals_autocast(pos):
    """``input``: q/k/v read the differentiated input itself, a leaf under jacrev."""
    model, gm = _pair(pos)
    x = _data()[0]
    params = _params(model)

    def out(module):
        return lambda inp: functional_call(module, params, (inp,))
    _assert_equal(jacrev(out(gm))(x), jacrev(_autocast(out(model)))(x))


@pytest.mark.parametrize("pos", [True, False], ids=["activation", "input"])
def test_func_grad_of_the_input_equals_autocast(pos):
    model, gm = _pair(pos)
    x, y, _ = _data()
    params = _params(model)
    want = grad(_autocast(_loss(model)), argnums=1)(params, x, y)
    _assert_equal(grad(_loss(gm), argnums=1)(params, x, y), want)


def test_vmap_per_sample_gradients_equal_autocast():
    model, gm = _pair()
    x, y, _ = _data()
    params = _params(model)

    def per_sample(module):
        def loss(p, sample, target):
            out = functional_call(module, p, (sample.unsqueeze(0),))
            return F.cross_entropy(out.float(), target.unsqueeze(0))
        return loss
    got = vmap(grad(per_sample(gm)), in_dims=(None, 0, 0))(params, x, y)
    want = vmap(grad(_autocast(per_sample(model))), in_dims=(None, 0, 0))(params, x, y)
    _assert_equal(got, want)


def test_func_jvp_equals_autocast_over_the_module_and_over_grad():
    """``func.jvp`` of the module, ``jacfwd`` of it, and forward over reverse (the
    Hessian-vector product of the loss: the fan-out's Function under jvp and grad)."""
    model, gm = _pair()
    x, y, tangent = _data()
    _assert_equal(jvp(gm, (x,), (tangent,)), jvp(_autocast(model), (x,), (tangent,)),
                  outputs=True)
    _assert_equal(torch.func.jacfwd(gm)(x[:1]), torch.func.jacfwd(_autocast(model))(x[:1]),
                  outputs=True)
    params = _params(model)
    torch.manual_seed(2)
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def hvp(loss):
        return jvp(lambda p: grad(loss)(p, x, y), (params,), (v,))
    _assert_equal(hvp(_loss(gm)), hvp(_autocast(_loss(model))))


def test_forward_ad_dual_numbers_equal_autocast_and_backward_still_does():
    model, gm = _pair()
    x, y, tangent = _data()
    results = []
    for module, fn in ((gm, gm), (model, _autocast(model))):
        with fwAD.dual_level():
            out = fn(fwAD.make_dual(x, tangent))
            primal, out_tangent = fwAD.unpack_dual(out)
        F.cross_entropy(primal.float(), y).backward()
        results.append(((primal, out_tangent), [p.grad for p in module.parameters()]))
    _assert_equal(results[0][0], results[1][0], outputs=True)
    _assert_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("strategy,vectorize", [("forward-mode", True), ("reverse-mode", True),
                                                ("reverse-mode", False)])
def test_autograd_functional_jacobian_equals_autocast(strategy, vectorize):
    """``torch.autograd.functional.jacobian`` of the input; forward-mode (which torch runs
    vectorized only) batches the tangents with the legacy vmap, outside ``torch.func``: the
    fan-out's eager Function gets batched tangents."""
    model, gm = _pair()
    x = _data()[0][:1]
    got = torch.autograd.functional.jacobian(gm, x, strategy=strategy, vectorize=vectorize)
    want = torch.autograd.functional.jacobian(_autocast(model), x, strategy=strategy,
                                              vectorize=vectorize)
    _assert_equal(got, want, outputs=True)


def _trained_once(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(module(x).float(), y).backward()
    module.zero_grad(set_to_none=True)


def test_func_grad_of_the_parameters_after_a_normal_training_step_equals_autocast():
    model, gm = _pair()
    x, y, _ = _data()
    _trained_once(gm, x, y)
    params = _params(model)
    _assert_equal(grad(_loss(gm))(params, x, y), grad(_autocast(_loss(model)))(params, x, y))


@pytest.mark.parametrize("policy", [None, "weights=cast"])
def test_func_grad_of_the_input_after_a_normal_training_step_equals_autocast(policy):
    """``func.grad`` of the input through the module as is (its own Parameters, captured by
    the transform) after it ran one forward and backward as usual."""
    model, gm = _pair(**({} if policy is None else {"policy": policy}))
    x, y, _ = _data()
    _trained_once(gm, x, y)

    def loss(fn):
        return lambda inp: F.cross_entropy(fn(inp).float(), y)
    _assert_equal(grad(loss(gm))(x), grad(loss(_autocast(model)))(x))


def test_func_grad_through_an_in_place_rewrite_equals_autocast():
    model, gm = _pair()
    x, y, _ = _data()
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    inplace = Attention()
    inplace.load_state_dict(reference.state_dict())
    rewritten = fxamp.amp_rewrite(inplace, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                                  inplace=True)
    assert rewritten is inplace
    params = _params(reference)
    want = grad(_autocast(_loss(reference)))(params, x, y)
    _assert_equal(grad(_loss(inplace))(params, x, y), want)
    per_sample = vmap(grad(lambda p, s, t: _loss(inplace)(p, s[None], t[None])),
                      in_dims=(None, 0, 0))(params, x, y)
    _assert_equal(per_sample, vmap(grad(_autocast(lambda p, s, t: _loss(reference)(
        p, s[None], t[None]))), in_dims=(None, 0, 0))(params, x, y))
