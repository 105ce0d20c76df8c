"""The eager front end's children compute as under torch.autocast: a model whose own forward
no tracer takes (it branches on a tensor value, as torchvision's detection models do) runs
its forward under autocast with each child rewritten; a child whose own forward is eager
too is planned for the low-precision inputs it really gets, so every child's inputs and
outputs have autocast's dtypes and a training step is autocast's, bit for bit. A child no
front end can plan for those inputs is planned for FP32 inputs, with a warning naming it.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List, Sequence

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp._torch import tree_flatten

DT = torch.bfloat16


class Anchors(nn.Module):
    """Like torchvision's AnchorGenerator: builds a tensor in the dtype of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(x.shape[-1], dtype=x.dtype) * 0.37


class Gate(nn.Module):
    """A child whose own forward no tracer takes (a branch on a tensor value), with a conv
    child, an op on no autocast list (``x * 0.3``) and an anchor-like child."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.anchors = Anchors()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.amax() > -1e4:
            x = x * 0.3
        return self.conv(x) + x + self.anchors(x)


class Levels(nn.Module):
    """Like torchvision's RPNHead, one conv over a list of feature maps, with no submodule,
    and a Python branch on a map's size: torch.fx cannot take the branch, and torch.export
    cannot run an FP32 bias on the bf16 maps it gets under autocast without autocast (it
    exports them as FP32, the front end's retry)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8, 1, 1) * 0.1)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, maps: List[torch.Tensor]) -> List[torch.Tensor]:
        scale = 0.3 if maps[0].shape[-1] > 1 else 1.0
        return [F.conv2d(m, self.weight, self.bias) * scale for m in maps]


class Neck(nn.Module):
    """A child torch.fx traces around its Gate (kept as a call, rewritten on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) * 1.5


class Detector(nn.Module):
    """A root whose forward branches on a tensor value: a conv stem, the eager Gate, the
    partly traced Neck, Levels and a Linear head. ``refine`` is called only on FP32 features
    (not under autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.gate = Gate()
        self.neck = Neck()
        self.levels = Levels()
        self.refine = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        if f.amax() > 1e4:
            f = f / 2
        g = self.neck(self.gate(f))
        if g.dtype == torch.float32:
            g = self.refine(g)
        levels = self.levels([g, g[:, :, ::2, ::2]])
        return self.head(g.mean((2, 3))) + sum(o.mean() for o in levels)


CHILDREN = ("stem", "gate", "gate.conv", "gate.anchors", "neck", "neck.gate", "neck.gate.conv",
            "neck.gate.anchors", "levels", "head")


def dtypes(value: Any) -> List[torch.dtype]:
    leaves, _ = tree_flatten(value)
    return [v.dtype for v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point()]


def recorded(model: nn.Module, paths: Sequence[str]) -> Dict[str, tuple]:
    """The (input dtypes, output dtypes) of each submodule's first call, filled as it runs."""
    seen: Dict[str, tuple] = {}
    for path in paths:
        def hook(_m: nn.Module, args: tuple, out: Any, path: str = path) -> None:
            seen.setdefault(path, (dtypes(args), dtypes(out)))
        model.get_submodule(path).register_forward_hook(hook)
    return seen


def step(model: nn.Module, run) -> tuple:
    out = run()
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_children_of_an_eager_root_have_autocasts_dtypes_and_train_like_autocast():
    torch.manual_seed(0)
    model, x = Detector().train(), torch.randn(2, 3, 8, 8)
    ref = copy.deepcopy(model)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=DT, target="cpu"))
    want, got = recorded(ref, CHILDREN), recorded(gm, CHILDREN)

    def autocast_run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=DT):
            return ref(x)

    ref_loss, ref_grads = step(ref, autocast_run)
    loss, grads = step(model, lambda: gm(x))
    assert want["gate.anchors"] == want["neck.gate.anchors"] == ([DT], [DT])
    assert got == want
    assert torch.equal(loss, ref_loss)
    for name in ref_grads:
        if ref_grads[name] is None:  # refine: not called under autocast
            assert grads[name] is None, name
        else:
            assert torch.equal(grads[name], ref_grads[name]), name
    plan = fxamp.plan_of(gm)
    assert plan.header["frontend"] == "eager"
    assert {"gate=eager", "neck=fx+runtime", "levels=export"} <= set(
        plan.header["nested"].split())
    assert not [n for n in ("gate", "neck", "neck/gate", "levels")
                if "FP32 inputs" in plan.nodes[n].reason]


def test_a_child_planned_for_fp32_inputs_is_a_warning_naming_it(caplog):
    """``refine`` is called only where the features are FP32, not under autocast: it is
    planned for the FP32 model's inputs, and a warning says so, naming it."""
    torch.manual_seed(0)
    model, x = Detector(), torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=DT, target="cpu"))
    assert "planned for FP32 inputs" in fxamp.plan_of(gm).nodes["refine"].reason
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "FP32 inputs" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("Detector.refine (nn.Conv2d)"), warned
    assert "not called when the model runs under torch.autocast" in warned[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fasterrcnn_mobilenet_v3_large_320_fpn", "retinanet"])
def test_torchvision_detection_children_and_training_step_match_autocast(name):
    """A detection model in train mode (losses out): every child's inputs and outputs have
    autocast's dtypes (the anchors are built in bf16, as under autocast), and the losses and
    gradients are autocast's, bit for bit."""
    from torchvision.models import detection
    torch.manual_seed(0)
    if name == "retinanet":
        model = detection.retinanet_resnet50_fpn(weights=None, weights_backbone=None,
                                                 num_classes=3, min_size=64, max_size=64)
        children = ("backbone", "anchor_generator", "head")
    else:
        model = detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64)
        children = ("backbone", "rpn", "rpn.head", "rpn.anchor_generator", "roi_heads",
                    "roi_heads.box_roi_pool", "roi_heads.box_head", "roi_heads.box_predictor")
    model.train()
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    targets = [{"boxes": torch.tensor([[4., 4., 30., 30.]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[10., 12., 50., 60.]]), "labels": torch.tensor([2])}]
    ref = copy.deepcopy(model)
    gm = fxamp.amp_rewrite(model, (images, targets),
                           fxamp.RewriteConfig.make(dtype=DT, target="cpu"))
    assert not [n for n, p in fxamp.plan_of(gm).nodes.items() if "FP32 inputs" in p.reason]
    want, got = recorded(ref, children), recorded(gm, children)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=DT):
        ref_losses = ref(images, targets)
    torch.manual_seed(1)
    losses = gm(images, targets)
    assert got == want
    assert losses.keys() == ref_losses.keys()
    assert all(torch.equal(losses[k], ref_losses[k]) for k in losses)
    sum(ref_losses.values()).backward()
    sum(losses.values()).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if n == "backbone.fpn.extra_blocks.p7.weight":
            # RetinaNet's P7 conv (3x3, stride 2) reads the 1x1 P6 map of a 64 px image:
            # torch's CPU bf16 weight gradient of a conv on a 1x1 input is not deterministic
            # (autocast itself gives another value, or NaN, from run to run)
            continue
        if q.grad is None:
            assert p.grad is None, n
        else:
            assert torch.equal(p.grad, q.grad), n
