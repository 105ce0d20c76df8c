"""amp_rewrite leaves the user's model exactly as it was (the LeViT cache case)."""
import copy
import logging

import pytest
import torch
import torch.nn as nn

import fxamp

BF16 = dict(target="cpu", dtype=torch.bfloat16)


class Cached(nn.Module):
    """A dict cache filled in eval-mode forward (as timm LeViT's attention biases) and a
    call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(8))
        self.cache = {}
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if "b" not in self.cache:
            self.cache["b"] = self.bias * 2
        return self.lin(x) + self.cache["b"]


def _state(model):
    """Every attribute of every submodule (identity), container contents and flags."""
    out = {}
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, dict):
                out[(path, name)] = (id(value), [(k, id(v)) for k, v in value.items()])
            elif isinstance(value, (int, float, bool, str)):
                out[(path, name)] = value
            else:
                out[(path, name)] = id(value)
    return out


def _x():
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(2))


def test_model_state_is_the_same_after_rewriting(caplog):
    model = Cached().eval()
    before = _state(model)
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    assert _state(model) == before
    assert model.cache == {} and model.calls == 0
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    warnings = [r.getMessage() for r in caplog.records if "changed its own state" in
                r.getMessage()]
    assert len(warnings) == 1
    assert "calls (set at File" in warnings[0] and "test_faithful_state.py" in warnings[0]
    assert "cache (changed in place)" in warnings[0]
    fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))  # a second rewrite works


def test_training_flags_buffers_and_hooks_unchanged():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.1)).train()
    model[1].eval()
    model[0].register_forward_hook(lambda m, i, o: o)
    stats = model[1].running_mean.clone()
    hooks = dict(model[0]._forward_hooks)
    fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert torch.equal(model[1].running_mean, stats)
    assert dict(model[0]._forward_hooks) == hooks


@pytest.fixture(scope="module")
def levit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("levit_128", pretrained=False).eval()


@pytest.mark.slow
def test_levit_rewritten_twice_and_its_deepcopy(levit):
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    caches = [m.attention_bias_cache for m in levit.modules()
              if hasattr(m, "attention_bias_cache")]
    assert caches and all(c == {} for c in caches)
    first = fxamp.amp_rewrite(levit, (x,), fxamp.RewriteConfig.make(**BF16))
    assert all(c == {} for c in caches)  # no fx Proxy (nor any tensor) left in them
    second = fxamp.amp_rewrite(levit, (x,), fxamp.RewriteConfig.make(**BF16))
    third = fxamp.amp_rewrite(copy.deepcopy(levit), (x,), fxamp.RewriteConfig.make(**BF16))
    with torch.no_grad():
        outs = [first(x), second(x), third(x)]
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(outs[2], outs[0])


class Kernelized(nn.Module):
    """A module holding helper modules in a plain dict, read (never written) by its
    forward, as ``kernels``' ``use_kernelized_func`` gives every HF Llama attention."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self._funcs = {"act": nn.GELU()}

    def forward(self, x):
        return self._funcs["act"](self.lin(x))


def test_a_dict_of_helpers_only_read_gives_no_side_effect_warning(caplog):
    """torch.export puts each module attribute back as a rebuilt container (its snapshot
    is a pytree copy): the same items in a new dict. That is not the model's side effect:
    no warning (every HF Llama warned of ``self_attn._kernel_funcs`` with ``kernels``
    installed), and the model keeps its own dict."""
    model = Kernelized()
    funcs = model._funcs
    with caplog.at_level(logging.WARNING):
        gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(
            frontend="export", **BF16))
    assert not [r for r in caplog.records if "changed its own state" in r.getMessage()]
    assert model._funcs is funcs and list(funcs.values())[0] is funcs["act"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(_x())
    assert torch.equal(gm(_x()).to(want.dtype), want)
