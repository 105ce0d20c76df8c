"""``amp_rewrite(model, ..., inplace=True)``: the model itself computes with the plan (same
object and class, keys, hooks), ``train()``/``eval()`` reach the graph, and it computes and
trains exactly like the model under ``torch.autocast`` (rewriter/inplace.py)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

BF16 = torch.bfloat16
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 2, 1, 0])


class Block(nn.Module):
    """Reads its own training flag (a container fx re-creates in the graph module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.relu(self.fc(x)), 0.5, training=self.training)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.block = Block()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.bn(self.inp(x))))


def _pair():
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    out = fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                            inplace=True)
    assert out is model
    return ref, model


def _autocast(ref, x):
    with torch.autocast("cpu", dtype=BF16):
        return ref(x)


def test_the_model_stays_the_same_object_with_the_same_keys_and_parameters():
    torch.manual_seed(0)
    model = Net()
    keys, params = list(model.state_dict()), list(model.parameters())
    names = [n for n, _ in model.named_modules()]
    fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    assert type(model) is Net
    assert list(model.state_dict()) == keys
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert [n for n, _ in model.named_modules()] == names
    assert fxamp.plan_of(model) is fxamp.plan_of(fxamp.rewritten(model))
    assert fxamp.config_of(model).policy.compute == BF16
    assert fxamp.rewritten(model) is not model


@pytest.mark.parametrize("modes", [(True, False, True), (False, True)])
def test_train_and_eval_of_the_model_reach_the_graph_and_equal_autocast(modes):
    ref, model = _pair()
    for mode in modes:
        model.train(mode)
        ref.train(mode)
        torch.manual_seed(7)
        got = model(X)
        torch.manual_seed(7)
        want = _autocast(ref, X)
        assert torch.equal(got, want), mode
        assert torch.equal(model.bn.running_mean, ref.bn.running_mean)


def test_training_steps_are_bit_identical_to_autocast():
    ref, model = _pair()
    for m in (model, ref):
        m.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, ref)]
    for step in range(3):
        for m, opt, ac in ((model, opts[0], False), (ref, opts[1], True)):
            torch.manual_seed(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16, enabled=ac):
                loss = F.cross_entropy(m(X).float(), Y)
            loss.backward()
            opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), step


def test_the_model_s_own_hooks_run_once_per_call():
    ref, model = _pair()
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(type(m).__name__))
    model.register_forward_hook(lambda m, args, out: calls.append("post"))
    model.eval()
    model(X)
    assert calls == ["Net", "post"]


def test_deepcopy_and_pickle_give_independent_models_that_compute_the_same():
    ref, model = _pair()
    model.eval()
    want = model(X)
    twin = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    for other in (twin, loaded):
        assert type(other) is Net and torch.equal(other(X), want)
        with torch.no_grad():
            other.head.bias.add_(1.0)
        assert torch.equal(model(X), want)  # the copy's weights are its own
        assert not torch.equal(other(X), want)
        other.train()
        assert other.block.training and not model.block.training


def test_compiled_in_place_model_equals_eager():
    ref, model = _pair()
    model.eval()
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(compiled(X), model(X))


def test_a_new_policy_rewrites_the_model_s_own_forward_again():
    ref, model = _pair()
    first = fxamp.plan_of(model)
    assert fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                             inplace=True) is model
    fxamp.amp_rewrite(model, (X,),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:head"),
                      inplace=True)
    plan = fxamp.plan_of(model)
    assert plan.nodes["head"].dtype == torch.float32 != first.nodes["head"].dtype
    gm = fxamp.amp_rewrite(model, (X,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:inp"))
    assert gm is not model and fxamp.plan_of(gm).nodes["inp"].dtype == torch.float32
    assert fxamp.plan_of(model) is plan  # the model keeps its own rewrite


def test_parameters_and_buffers_set_on_the_model_after_the_rewrite_are_used():
    ref, model = _pair()
    for m in (model, ref):
        m.eval()
        m.head.weight = nn.Parameter(torch.ones(3, 16) / 16)  # a new Parameter object
        m.bn.running_var = torch.full((16,), 4.0)  # a new buffer (what model.to() does)
    assert torch.equal(model(X), _autocast(ref, X))
    F.cross_entropy(model(X).float(), Y).backward()
    assert model.head.weight.grad is not None  # gradients reach the new Parameter
