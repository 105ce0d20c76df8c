"""amp_rewrite on the model's own device: ``meta`` and fake ``cuda``, both targets.

A GPU user moves the model to ``cuda`` before rewriting it. Without a GPU the same path is
exercised two ways: the model and its inputs on device ``meta``, and as fake CUDA tensors
(``FakeTensorMode``; ``autocast_truth._fake_cuda_copy``). For each, the rewrite must not
move anything between devices (parameters and buffers stay where the model's are, the
output comes out there) and must plan every node exactly as for the same model on cpu.
Also: a float64 model, which autocast leaves alone, stays float64 node by node.
"""
from __future__ import annotations

import copy
import functools
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fxamp
from autocast_truth import _fake_cuda_copy, _fake_cuda_like, autocast_rewrite
from test_models_handwritten import MODELS as HANDWRITTEN
from test_models_handwritten import make
from test_torchvision_agreement import MODELS as TORCHVISION
from test_torchvision_agreement import SIZE

TARGETS = ["cpu", "cuda"]
DEVICES = ["meta", "fake-cuda"]

#: the torchvision models of the agreement tests taken here: CNNs with BatchNorm (ResNet,
#: EfficientNet: squeeze-excitation, stochastic depth), ConvNeXt (LayerNorm, layer scale),
#: ViT (nn.MultiheadAttention), Swin (window attention) - the kinds the issue saw fail on a GPU
TORCHVISION_HERE = ["resnet18", "efficientnet_b0", "convnext_small", "vit_small", "swin_small"]



def _torchvision(name: str) -> Callable[[], Tuple[nn.Module, tuple]]:
    def build() -> Tuple[nn.Module, tuple]:
        torch.manual_seed(0)
        return TORCHVISION[name]().eval(), (torch.randn(1, 3, SIZE, SIZE),)
    return build


MODELS: Dict[str, Callable[[], Tuple[nn.Module, tuple]]] = {
    **{name: (lambda name=name: make(name)) for name in HANDWRITTEN},
    **{name: _torchvision(name) for name in TORCHVISION_HERE},
}


def _dtypes(plan: fxamp.Plan) -> Dict[str, torch.dtype]:
    return {name: p.dtype for name, p in plan.nodes.items()}


@functools.lru_cache(maxsize=None)
def _cpu_plan(name: str, target: str) -> Dict[str, torch.dtype]:
    """The plan of the model on cpu: what every device must reproduce."""
    model, inputs = MODELS[name]()
    return _dtypes(fxamp.plan_of(autocast_rewrite(model, inputs, dtype=torch.float16,
                                                  target=target)))


def _devices(module: nn.Module) -> set:
    return {t.device.type for t in list(module.parameters()) + list(module.buffers())}


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value
    return next(t for t in (_first_tensor(v) for v in items) if t is not None)


def _cases() -> list:
    """(name, device) parameters; the torchvision models and the fake-cuda copies are slow
    (the fast tier keeps each hand-written model on meta)."""
    return [pytest.param(name, device, id=f"{name}-{device}",
                         marks=pytest.mark.slow if name in TORCHVISION_HERE
                         or device != "meta" else ())
            for name in MODELS for device in DEVICES]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name, device", _cases())
def test_rewrite_on_the_models_device(name: str, device: str, target: str) -> None:
    """Planned as on cpu, node by node; nothing leaves the model's device."""
    model, inputs = MODELS[name]()
    if device == "meta":
        moved = copy.deepcopy(model).to("meta")
        moved_inputs = tuple(t.to("meta") for t in inputs)
        gm = autocast_rewrite(moved, moved_inputs, dtype=torch.float16, target=target)
        out = gm(*moved_inputs)
        expected = "meta"
    else:
        mode = FakeTensorMode()
        with mode:
            moved = _fake_cuda_copy(model)
            moved_inputs = tuple(_fake_cuda_like(t) for t in inputs)
        gm = autocast_rewrite(moved, moved_inputs, dtype=torch.float16, target=target)
        expected = "cuda"
        out = None
        if target == "cuda":
            # (a CUDA model planned with CPU's lists: its runtime nodes run under CUDA
            # autocast, whose dtypes need not be CPU's — a limit the README states)
            with mode:
                out = gm(*moved_inputs)
    assert _devices(gm) == _devices(moved) == {expected}
    if out is not None:
        assert _first_tensor(out).device.type == expected
    got, want = _dtypes(fxamp.plan_of(gm)), _cpu_plan(name, target)
    wrong = {n: (got.get(n), want.get(n)) for n in list(want) + list(got)
             if got.get(n) != want.get(n)}
    assert not wrong, f"node: (planned on {device}, planned on cpu): {wrong}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_float64_model_stays_float64(dtype: torch.dtype, target: str) -> None:
    """Autocast leaves float64 alone: every node is planned float64 and the rewritten
    model's output equals the original's exactly (also under CPU autocast)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=dtype, target=target))
    plan = fxamp.plan_of(gm)
    assert list(plan.nodes) == ["input_1", "_0", "_1", "_2"]
    assert {name: p.dtype for name, p in plan.nodes.items()} == {
        name: torch.float64 for name in plan.nodes}
    # no input is cast to the low dtype: "inputs" is float64 or "left as they come"
    assert {name: p.inputs for name, p in plan.nodes.items() if p.inputs not in (
        None, torch.float64)} == {}
    with torch.no_grad():
        want = model(x)
        with torch.autocast("cpu", dtype=dtype):
            under_autocast = model(x)
        got = gm(x)
    assert want.dtype == under_autocast.dtype == got.dtype == torch.float64
    assert torch.equal(under_autocast, want)
    assert torch.equal(got, want)
