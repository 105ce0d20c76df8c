"""torch.distributed (gloo, 2 processes): DDP around an in-place rewritten model, and FSDP2
``fully_shard`` of its root after the rewrite, train exactly like the same wrapper around
the original under autocast, and so do no-grad evaluations around ``set_model_state_dict``
loads (weights=o2: after ``refresh_weights``); ``fully_shard`` before the rewrite, or of
submodules, is refused with an error that names the order that works (never a silent
difference)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _spawned import run_spawned

BF16 = torch.bfloat16
pytestmark = pytest.mark.slow  # two spawned processes


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _ddp(rank: int) -> list:
    import fxamp
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ref = _mlp()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    (losses, params), (ref_losses, ref_params) = (_train(DDP(model), x, False),
                                                  _train(DDP(ref), x, True))
    return [losses == ref_losses and ref_losses[-1] < ref_losses[0],
            all(torch.equal(p, q) for p, q in zip(params, ref_params))]


def _train(model: nn.Module, x: torch.Tensor, autocast: bool) -> tuple:
    y = torch.tensor([0, 1, 2, 0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return losses, [p.detach().clone() for p in full]


def _fsdp2_root(rank: int) -> list:
    """Rewrite in place, then fully_shard the root: equal to FSDP2 + autocast."""
    import fxamp
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ref = _mlp()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    fully_shard(model)
    fully_shard(ref)
    (losses, params), (ref_losses, ref_params) = _train(model, x, False), _train(ref, x, True)
    return [losses == ref_losses and ref_losses[-1] < ref_losses[0],
            all(torch.equal(p, q) for p, q in zip(params, ref_params))]


def _state_dict(seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) for k, v in _mlp().state_dict().items()}


def _loads_then_evals(model: nn.Module, x: torch.Tensor, autocast: bool, target=None) -> tuple:
    """Load, no-grad eval, load another, eval, train a step, eval: the eval logits (and,
    with ``target``, what ``refresh_weights(target)`` returned after each load; the
    optimizer is attached to ``target``: weights=o2)."""
    import fxamp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if target is not None:
        fxamp.train.attach_optimizer(target, opt)
    logits, refreshed = [], []

    def load(seed: int) -> None:
        set_model_state_dict(model, _state_dict(seed),
                             options=StateDictOptions(full_state_dict=True))
        if target is not None:  # o2 copies do not see a load
            refreshed.append(fxamp.train.refresh_weights(target))

    def evaluate() -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
            logits.append(model(x).float())

    load(1)
    evaluate()
    load(2)
    evaluate()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        F.cross_entropy(model(x).float(), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    evaluate()
    return logits, refreshed


def _fsdp2_loads(rank: int, how: str) -> list:
    """FSDP2 of the root around state-dict loads and no-grad evals, against FSDP2 +
    autocast on the original. ``reshard_after_forward=True``: FSDP2 leaves a root gathered
    after a forward without grad otherwise, and then refuses the next load (autocast too)."""
    import fxamp
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ref = _mlp()
    model = copy.deepcopy(ref)
    policy = None if how == "default" else "weights=o2"
    fxamp.amp_rewrite(model, (x,),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy=policy),
                      inplace=True)
    fully_shard(model, reshard_after_forward=True)
    fully_shard(ref, reshard_after_forward=True)
    target = {"default": None, "o2 in place": model,
              "o2 rewritten": fxamp.rewritten(model)}[how]
    try:
        logits, refreshed = _loads_then_evals(model, x, False, target)
    except Exception as err:  # noqa: BLE001 - reported to this case's test alone
        return [f"{type(err).__name__}: {err}"]
    expected, _ = _loads_then_evals(ref, x, True)
    return [torch.equal(a, b) for a, b in zip(logits, expected)] + refreshed


def _fsdp2_refused(order: str) -> str:
    import fxamp
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, 8)
    model = _mlp()
    try:
        if order == "submodules after":
            fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                              inplace=True)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        if order == "before":
            fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                              inplace=True)
        model(x)
    except fxamp.UnsupportedModelError as err:
        return str(err)
    return "no error"


def _all(rank: int) -> dict:
    return {"ddp": _ddp(rank), "fsdp2 root": _fsdp2_root(rank),
            **{f"loads {how}": _fsdp2_loads(rank, how)
               for how in ("default", "o2 in place", "o2 rewritten")},
            "before": _fsdp2_refused("before"),
            "submodules after": _fsdp2_refused("submodules after")}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_spawned(_all, timeout=300)


def test_ddp_around_the_in_place_model_trains_like_ddp_with_autocast(results):
    for rank in (0, 1):
        assert results[rank]["ddp"] == [True, True], rank


def test_fsdp2_of_the_root_after_an_in_place_rewrite_trains_like_fsdp2_with_autocast(
        results):
    for rank in (0, 1):
        assert results[rank]["fsdp2 root"] == [True, True], rank


def test_fsdp2_evals_around_state_dict_loads_equal_fsdp2_with_autocast(results):
    """The default casts every weight on every forward: nothing can be stale."""
    for rank in (0, 1):
        assert results[rank]["loads default"] == [True, True, True], rank


@pytest.mark.parametrize("view", ["in place", "rewritten"])
def test_fsdp2_o2_evals_after_refresh_weights_equal_fsdp2_with_autocast(results, view):
    """weights=o2: the attached step re-casts after training, and refresh_weights after a
    load marks all 6 copies (their memory is freed between all-gathers) for the next
    forward to cast."""
    for rank in (0, 1):
        assert results[rank][f"loads o2 {view}"] == [True, True, True, 6, 6], rank


@pytest.mark.parametrize("order", ["before", "submodules after"])
def test_other_fsdp2_orders_are_refused_naming_the_one_that_works(results, order):
    for rank in (0, 1):
        text = results[rank][order]
        assert "fully_shard(model) on the root alone" in text, text
