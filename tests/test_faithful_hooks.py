"""Hooks and parametrizations behave in the rewritten model as in the model under autocast."""
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

import fxamp
from fxamp.errors import TraceError, UnsupportedModelError

BF16 = dict(target="cpu", dtype=torch.bfloat16)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin2(torch.relu(self.lin(x)))


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _grads(model, call, x):
    """``call(x)``'s output and the gradients it leaves on ``model``'s parameters."""
    out = call(x)
    out.float().pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


def _autocast_grads(model, x):
    def under_autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)
    return _grads(model, under_autocast, x)


def _rewritten_grads(model, gm, x):
    return _grads(model, gm, x)


def _same_as_autocast(model, gm, x):
    ref, ref_grads = _autocast_grads(model, x)
    out, grads = _rewritten_grads(model, gm, x)
    assert _rel(out, ref) < 1e-2
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:  # bf16 rounding apart (the rewritten model returns FP32)
        assert _rel(grads[name], ref_grads[name]) < 1e-2, name


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _no_fakes(model):
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            assert not isinstance(value, FakeTensor), f"{path}.{name} is a FakeTensor"
        for name, value in list(module.named_parameters(recurse=False)) + list(
                module.named_buffers(recurse=False)):
            assert not isinstance(value, FakeTensor), f"{path}.{name} is a FakeTensor"


def test_forward_hook_on_a_child_runs():
    model = Net()
    model.lin.register_forward_hook(lambda mod, inp, out: out * 2)
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    _same_as_autocast(model, gm, _x())
    assert fxamp.plan_of(gm).nodes["lin"].rule == "runtime"


def test_forward_pre_hooks_on_child_and_root_run():
    model = Net()
    model.lin2.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    model.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    _same_as_autocast(model, gm, _x())


def test_side_effect_hook_sees_each_call():
    model = Net()
    seen = []
    model.lin.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    seen.clear()
    gm(_x())
    gm(_x())
    assert seen == [torch.bfloat16, torch.bfloat16]


def test_full_backward_hook_runs_with_the_same_gradients():
    model = Net()
    grads = []
    model.lin2.register_full_backward_hook(
        lambda mod, gin, gout: grads.append(gout[0].detach().clone()))
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    _autocast_grads(model, _x())
    _rewritten_grads(model, gm, _x())
    assert len(grads) == 2
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_root_hooks_move_to_the_rewritten_module_and_run_once(frontend):
    model = Net()
    model.register_forward_hook(lambda mod, inp, out: out * 10)
    model.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    _same_as_autocast(model, gm, _x())


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_old_style_weight_and_spectral_norm(norm):
    model = Net()
    wrap = getattr(torch.nn.utils, norm)
    with pytest.warns(FutureWarning) if norm == "weight_norm" else _nothing():
        model.lin = wrap(model.lin)
    model.eval()  # spectral_norm's power iteration changes its buffers in train mode
    before = model.lin.weight
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    _no_fakes(model)
    assert model.lin.weight is before
    out = gm(_x())
    assert type(out) is torch.Tensor
    _same_as_autocast(model, gm, _x())
    names = {n for n, _ in model.named_parameters()}
    assert {"lin.weight_g", "lin.weight_v"} <= names or "lin.weight_orig" in names


def test_spectral_norm_in_train_mode_keeps_its_buffers():
    model = Net()
    model.lin = torch.nn.utils.spectral_norm(model.lin)
    u = model.lin.weight_u.clone()
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    _no_fakes(model)
    assert torch.equal(model.lin.weight_u, u)  # the rewrite runs no power iteration
    gm(_x())
    assert not torch.equal(model.lin.weight_u, u)  # the rewritten model does, as the model


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_parametrizations_weight_norm():
    model = Net()
    model.lin = torch.nn.utils.parametrizations.weight_norm(model.lin)
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    _no_fakes(model)
    _same_as_autocast(model, gm, _x())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_root_full_backward_hook_runs_with_the_same_gradients():
    model = Net()
    grads = []
    model.register_full_backward_hook(
        lambda mod, gin, gout: grads.append(gout[0].detach().clone()))
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    _autocast_grads(model, _x())
    _rewritten_grads(model, gm, _x())
    assert len(grads) == 2
    torch.testing.assert_close(grads[1].float(), grads[0].float())


class WithUnused(Net):
    """A submodule and a Parameter this forward never uses (as GoogLeNet's aux heads in eval
    mode), and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Sequential(nn.Linear(16, 2))
        self.temperature = nn.Parameter(torch.ones(1))
        self.register_buffer("steps", torch.zeros(1), persistent=False)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_state_dict_has_the_models_keys_with_unused_parts(frontend):
    model = WithUnused()
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    mine, theirs = gm.state_dict(), model.state_dict()
    assert sorted(mine) == sorted(theirs)
    assert "steps" not in mine
    gm.load_state_dict({k: v.clone() for k, v in theirs.items()})
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}


def test_state_dict_matches_and_state_dict_hook_kept():
    model = Net()
    model.lin.register_forward_hook(lambda mod, inp, out: out)
    model._register_state_dict_hook(
        lambda mod, state, prefix, local: state.__setitem__(prefix + "extra", torch.ones(1)))
    gm = fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16))
    mine, theirs = gm.state_dict(), model.state_dict()
    assert sorted(mine) == sorted(theirs)
    assert "extra" in mine
    for key in theirs:
        assert torch.equal(mine[key], theirs[key])
    loadable = {k: v.clone() for k, v in theirs.items() if k != "extra"}
    gm.load_state_dict(loadable)
    model.load_state_dict(loadable)


def test_global_module_hook_is_refused():
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: None)
    try:
        with pytest.raises(UnsupportedModelError, match="global module hooks"):
            fxamp.amp_rewrite(Net(), (_x(),), fxamp.RewriteConfig.make(**BF16))
    finally:
        handle.remove()


def test_export_front_end_refuses_hooks_naming_the_module():
    model = Net()
    model.lin2.register_forward_hook(lambda mod, inp, out: out * 2)
    with pytest.raises(TraceError, match=r"Net\.lin2 .*forward_hook"):
        fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(frontend="export", **BF16))


@pytest.mark.parametrize("when", ["example", "after the first call"])
def test_a_hook_on_a_submodule_sees_only_the_users_calls_never_the_planning_runs(when):
    """Planning runs a hooked submodule (kept as a call) on fake tensors under autocast to
    learn its dtypes; the user's hook fired there, on a FakeTensor: once more per plan."""
    model = Net()
    seen = []

    def hook(module, args, out):
        seen.append(type(out))

    if when == "example":
        model.lin.register_forward_hook(hook)
        fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16), inplace=True)
    else:
        fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(**BF16), inplace=True)
        model(_x())
        model.lin.register_forward_hook(hook)  # (the next call plans again: a hook)
    assert seen == []
    model(_x())
    model(_x())
    assert seen == [torch.Tensor, torch.Tensor]
