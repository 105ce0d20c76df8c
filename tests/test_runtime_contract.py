"""What runs on each call of a rewritten model (fxamp/program.py, fxamp/structure.py): autocast
restored on every exit path, the structure and late-hook check over every graph part, the
model followed (in place: re-planned on a structural change), weights cast like autocast
casts them (nothing held between steps), no global hook left installed. Each compared with
the same model under torch.autocast."""
from __future__ import annotations

import copy
import cProfile
import gc
import pstats

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxamp
from fxamp.errors import FxampError, UnsupportedModelError

BF16 = dict(dtype=torch.bfloat16, target="cpu")


class MLP(nn.Module):
    def __init__(self, d: int = 16, out: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


class Boom(nn.Module):
    """Raises inside the graph when given a negative batch marker."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[idx]  # an index out of range raises in the graph


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.block, x, use_reentrant=False)
        return self.head(x)


def _autocast_out(model: nn.Module, *args):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*args)


def _grads(model: nn.Module):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


# -- exception safety -----------------------------------------------------------------------

@pytest.mark.parametrize("inplace", [False, True])
def test_a_graph_that_raises_under_autocast_leaves_the_users_autocast_on(inplace):
    torch.manual_seed(0)
    model = Boom()
    x, good = torch.randn(4, 8), torch.tensor([0, 1])
    gm = fxamp.amp_rewrite(model, (x, good), inplace=inplace,
                           config=fxamp.RewriteConfig.make(**BF16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(IndexError):
            gm(x, torch.tensor([99]))
        assert torch.is_autocast_enabled("cpu")  # the user's autocast is still on
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


# -- late hooks in every graph part -----------------------------------------------------------

def test_a_late_hook_inside_a_checkpoint_region_is_refused_by_name():
    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(4, 8, requires_grad=True)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    assert any(type(m).__name__ == "CheckpointRegion" for m in gm.modules())
    gm(x).sum().backward()
    handle = model.block[0].register_forward_hook(lambda m, i, o: None)
    with pytest.raises(UnsupportedModelError, match=r"block\.0 \(forward_hook"):
        gm(x)
    handle.remove()
    gm(x)  # removed: runs again


# -- process-wide state ---------------------------------------------------------------------

_HOOK_PROBE = """
import torch, torch.nn as nn
from torch.optim import optimizer as o
before = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))
import fxamp
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
gm = fxamp.amp_rewrite(model, (torch.randn(2, 4),),
                       fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gm(torch.randn(2, 4)).sum().backward()
opt.step()
print(before == (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks)))
"""


def test_a_rewrite_leaves_no_global_optimizer_hook():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HOOK_PROBE], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]


# -- weights cast like autocast: nothing held between steps ---------------------------------

def _live_tensor_bytes() -> int:
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - a tensor without storage (fake, sparse)
            continue
    return sum(seen.values())


def _two_steps(model, forward, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = F.cross_entropy(forward(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del loss
    return opt


@pytest.mark.parametrize("inplace", [False, True])
def test_bytes_held_between_training_steps_equal_autocasts(inplace):
    torch.manual_seed(0)
    x, y = torch.randn(8, 256), torch.randint(0, 4, (8,))
    ref, model = MLP(256), MLP(256)
    model.load_state_dict(ref.state_dict())
    # autocast: the model, its optimizer state, nothing else
    opt_a = _two_steps(ref, lambda v: _autocast_out(ref, v), x, y)
    held_autocast = _live_tensor_bytes()
    del opt_a
    gm = fxamp.amp_rewrite(model, (x,), inplace=inplace, config=fxamp.RewriteConfig.make(**BF16))
    opt_f = _two_steps(model, gm, x, y)
    held_fxamp = _live_tensor_bytes()
    del opt_f
    assert held_fxamp == held_autocast
    assert fxamp.weight_cache_bytes(gm) == 0


def test_python_calls_per_training_forward_within_1_3x_the_plain_models():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16)
    plain = copy.deepcopy(model)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    gm(x).sum().backward()

    def calls(fn) -> int:
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        return pstats.Stats(prof).total_calls

    assert calls(lambda: gm(x)) <= 1.3 * calls(lambda: plain(x))


# -- in place: the model is followed, not mirrored -----------------------------------------

def test_a_head_replaced_after_an_inplace_rewrite_is_used_and_trained():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=1000)
    x = torch.randn(2, 3, 64, 64)
    fxamp.amp_rewrite(model, (x,), inplace=True, config=fxamp.RewriteConfig.make(**BF16))
    model.fc = nn.Linear(512, 10)  # the fine-tuning pattern
    ref = copy.deepcopy(model)
    ref.__dict__.pop("forward")  # the original forward, under autocast
    out = model(x)
    assert out.shape == (2, 10)
    out.float().sum().backward()
    want = _autocast_out(ref, x)
    want.float().sum().backward()
    assert torch.equal(out, want)
    assert model.fc.weight.grad is not None
    assert torch.equal(model.fc.weight.grad, ref.fc.weight.grad)


def _inplace_pair(model, x):
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, (x,), inplace=True, config=fxamp.RewriteConfig.make(**BF16))
    return ref


@pytest.mark.parametrize("change,cause", [("delete the head", "head"), ("half", "float16")])
def test_a_deleted_submodule_or_half_is_named_not_ignored(change, cause):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16)
    fxamp.amp_rewrite(model, (x,), inplace=True, config=fxamp.RewriteConfig.make(**BF16))
    if change == "half":
        model.half()  # (refused: fxamp keeps FP32 master weights)
    else:
        del model.head  # (planned again: the model's own forward fails, named)
    with pytest.raises(FxampError, match=cause):
        model(x)


def test_a_patched_block_forward_is_followed():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16)
    ref = _inplace_pair(model, x)
    for m in (model, ref):  # (fx traced into the Sequential: its ops are in the graph)
        body = m.body
        m.body.forward = lambda v, body=body: body[1](body[0](v)) * 2
    assert torch.equal(model(x), _autocast_out(ref, x))


@pytest.mark.parametrize("change", ["parametrization", "weight_norm", "prune"])
def test_a_parametrization_after_an_inplace_rewrite_is_followed(change):
    from torch.nn.utils import parametrize, prune

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16)
    ref = _inplace_pair(model, x)
    for m in (model, ref):
        if change == "parametrization":
            parametrize.register_parametrization(m.head, "weight", Double())
        elif change == "weight_norm":
            nn.utils.parametrizations.weight_norm(m.head)
        else:
            torch.manual_seed(1)
            prune.l1_unstructured(m.head, "weight", amount=0.5)
    out = model(x)
    want = _autocast_out(ref, x)
    assert torch.equal(out, want)
    out.float().sum().backward()
    want.float().sum().backward()
    assert _grads(model).keys() == _grads(ref).keys()
    for k, g in _grads(ref).items():
        assert torch.equal(_grads(model)[k], g), k


def test_double_after_an_inplace_rewrite_computes_in_float64_like_autocast():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16)
    ref = _inplace_pair(model, x)
    model.double()
    ref.double()
    x64 = x.double().requires_grad_()
    assert torch.equal(model(x64), _autocast_out(ref, x64))
    assert torch.autograd.gradcheck(lambda v: model(v), (x64[:1].detach().requires_grad_(),))


@pytest.mark.parametrize("inplace", [False, True])
def test_load_state_dict_assign_is_followed(inplace):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16)
    gm = fxamp.amp_rewrite(model, (x,), inplace=inplace, config=fxamp.RewriteConfig.make(**BF16))
    other = MLP()
    model.load_state_dict(other.state_dict(), assign=True)
    assert torch.equal(gm(x), _autocast_out(other, x))
    # new Parameter objects set on a module are followed too
    model.head.weight = nn.Parameter(torch.zeros_like(model.head.weight))
    other.head.weight = nn.Parameter(torch.zeros_like(other.head.weight))
    assert torch.equal(gm(x), _autocast_out(other, x))


def test_train_and_eval_reach_the_graph_in_place_without_per_call_copies():
    torch.manual_seed(0)

    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.lin(x))

    model, x = Drop(), torch.randn(4, 8)
    ref = _inplace_pair(model, x)
    model.eval()
    ref.eval()
    assert torch.equal(model(x), _autocast_out(ref, x))
    model.train()
    ref.train()
    torch.manual_seed(3)
    out = model(x)
    torch.manual_seed(3)
    assert torch.equal(out, _autocast_out(ref, x))


def test_a_structural_change_is_refused_by_the_returned_module():
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    parametrize.register_parametrization(model.head, "weight", Double())
    with pytest.raises(UnsupportedModelError, match="head became a ParametrizedLinear"):
        gm(x)


# -- one attribute; weights fresh under threads ---------------------------------------------

@pytest.mark.parametrize("inplace", [False, True])
def test_the_result_is_one_attribute(inplace):
    model, x = MLP(), torch.randn(2, 16)
    out = fxamp.amp_rewrite(model, (x,), inplace=inplace, config=fxamp.RewriteConfig.make(**BF16))
    gm = fxamp.rewritten(out)
    assert sorted(k for k in gm.__dict__ if "fxamp" in k) == ["fxamp_result"]
    if inplace:
        assert sorted(k for k in model.__dict__ if "fxamp" in k) == ["_fxamp_rewritten",
                                                                     "fxamp_result"]


def test_eval_threads_next_to_a_fused_adamw_trainer_see_the_trained_weights():
    import threading

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 16)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    y = torch.randint(0, 4, (4,))
    for _ in range(4):  # rounds: the trainer and two evaluators overlap
        stop = threading.Event()
        outs: list = []

        def evaluate() -> None:
            while not stop.is_set():
                with torch.no_grad():
                    gm(x)
            with torch.no_grad():
                outs.append(gm(x))

        threads = [threading.Thread(target=evaluate) for _ in range(2)]
        for t in threads:
            t.start()
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(gm(x), y).backward()
            opt.step()
        stop.set()
        for t in threads:
            t.join()
        want = _autocast_out(model, x).float()
        assert all(torch.equal(o, want) for o in outs)


def test_nested_modules_cost_linear_attribute_lookups_per_call():
    class Level(nn.Module):
        def __init__(self, depth: int) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.child = Level(depth - 1) if depth > 1 else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.lin(x)
            return self.child(x) if self.child is not None else x

    model, x = Level(60), torch.randn(2, 4)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    gm(x)
    prof = cProfile.Profile()
    prof.enable()
    gm(x)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    lookups = sum(v[1] for k, v in stats.items() if k[2] == "__getattr__")
    assert lookups <= 4 * 60  # a path read once per level (a chain from self: ~60 * 60 / 2)
