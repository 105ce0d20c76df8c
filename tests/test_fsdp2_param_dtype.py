"""FSDP2 ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16))`` after an
in-place rewrite: the policy all-gathers the Parameters in BF16 for
forward, which fxamp refuses (it keeps FP32 master weights). The refusal names the cause,
the policy's ``param_dtype``, and what to do, instead of advising ``model.float()`` before
amp_rewrite, which is what was done. The advice is followed: ``fully_shard`` without
``param_dtype`` computes as the same sharding under torch.autocast.

One process (gloo, world size 1) is enough for ``fully_shard``; it runs in a spawned
process so the test process keeps no process group.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _spawned import run_spawned

BF16 = torch.bfloat16
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).relu()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _shard(model: nn.Module, **kwargs) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _helper_sees_the_policy() -> str:
    """check_parameter_dtypes on a block while FSDP2 has gathered its Parameters in BF16
    (a forward pre-hook registered after fully_shard's runs after it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fxamp.frontends.model_checks import check_parameter_dtypes

    torch.manual_seed(0)
    model = Net()
    _shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    seen = []

    def hook(module: nn.Module, args: tuple) -> None:
        try:
            check_parameter_dtypes(module)
        except Exception as err:  # noqa: BLE001 - reported to the test
            seen.append(f"{type(err).__name__}: {err}")

    model.layers[0].register_forward_pre_hook(hook)
    model(torch.randn(4, 8))
    return seen[0] if seen else "no error"


def _in_place_refusal() -> str:
    import fxamp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = Net()
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    _shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    try:
        model(torch.randn(4, 8))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def _planned_then_sharded_refusal() -> str:
    """The model planned on a first call, then sharded with param_dtype: the next call sees
    BF16 Parameters as a change since its plan."""
    import fxamp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = Net()
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    model(torch.randn(4, 8))
    _shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    try:
        model(torch.randn(4, 8))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def _advice_followed() -> list:
    import fxamp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    _shard(model, mp_policy=MixedPrecisionPolicy())  # param_dtype left out
    _shard(ref)
    x = torch.randn(4, 8)
    out = model(x)
    with torch.autocast("cpu", dtype=BF16):
        expected = ref(x)
    out.sum().backward()
    expected.float().sum().backward()
    return [torch.equal(out, expected.float()),
            all(torch.equal(p.grad.full_tensor(), q.grad.full_tensor())
                for p, q in zip(model.parameters(), ref.parameters()))]


def _all(rank: int) -> dict:
    return {"helper": _helper_sees_the_policy(), "in_place": _in_place_refusal(),
            "planned": _planned_then_sharded_refusal(), "advice": _advice_followed()}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_spawned(_all, world_size=1, timeout=300)[0]


def _names_the_policy(text: str) -> None:
    assert text.startswith("UnsupportedModelError"), text
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in text, text
    assert "leave param_dtype out" in text and "model.float()" not in text, text


def test_parameter_check_names_fsdp2_param_dtype_as_the_cause(results) -> None:
    _names_the_policy(results["helper"])


def test_in_place_model_sharded_with_param_dtype_is_refused_naming_the_policy(results):
    _names_the_policy(results["in_place"])


def test_a_model_planned_then_sharded_with_param_dtype_is_refused_naming_the_policy_first(
        results):
    text = results["planned"]
    _names_the_policy(text)
    assert "half()" not in text, text  # (not blamed on a dtype change of the user's)


def test_following_the_advice_fully_shard_without_param_dtype_matches_autocast(results):
    assert results["advice"] == [True, True]
