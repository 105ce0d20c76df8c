"""Policy ``channels_last=on``: conv weights and 4-D inputs in NHWC, same results, trains."""
import copy
import logging
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode

import fxamp
from fxamp.policy import Policy

BF16 = torch.bfloat16
CL = torch.channels_last


class TinyConvNet(nn.Module):
    """Conv modules, a functional conv on a Parameter, a transposed conv, BN, pool, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.extra = nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv1(x)))
        h = F.conv2d(h, self.extra, padding=1)
        h = self.up(F.max_pool2d(h, 2))
        return self.head(h.mean((2, 3)))


class _ConvInputs(TorchDispatchMode):
    """Records, for each aten.convolution, whether its input and weight are channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.seen.append((args[0].is_contiguous(memory_format=CL),
                              args[1].is_contiguous(memory_format=CL), args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_policy_string_form_round_trips_with_channels_last():
    p = Policy.parse("compute=bf16,target=cpu,channels_last=on,fp32:head")
    assert p.channels_last is True
    assert str(p) == "compute=bf16,target=cpu,channels_last=on,fp32:head"
    assert Policy.parse(str(p)) == p
    q = Policy.parse("numerics=off,channels_last=true")
    assert q.channels_last and Policy.parse(str(q)) == q
    assert not Policy.parse("channels_last=off").channels_last
    assert "channels_last" not in str(Policy())
    with pytest.raises(fxamp.FxampError, match="channels_last takes on or off"):
        Policy.parse("channels_last=nhwc")


def test_channels_last_runs_convs_in_nhwc_with_the_same_outputs_and_parameters():
    torch.manual_seed(0)
    model = TinyConvNet().train()
    x = torch.randn(2, 3, 16, 16)
    originals = dict(model.named_parameters())
    off = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    with _ConvInputs() as mode:
        out_off = off(x)
    assert mode.seen and not any(inp for inp, _, _ in mode.seen)  # NCHW without the option

    on = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                    policy="channels_last=on"))
    assert fxamp.plan_of(on).nodes == fxamp.plan_of(off).nodes  # the precision plan is unchanged
    assert "memory_format = torch.channels_last" in on.code
    with _ConvInputs() as mode:
        out_on = on(x)
    assert len(mode.seen) == 3
    assert all(inp and weight and dtype == BF16 for inp, weight, dtype in mode.seen)
    torch.testing.assert_close(out_on, out_off, rtol=2e-2, atol=2e-2)

    # the same Parameter objects, shared with the model; 4-D weights now channels_last
    for name, p in on.named_parameters():
        assert p is originals[name], name
    for p in (model.conv1.weight, model.extra, model.up.weight):
        assert p.dtype == torch.float32 and p.is_contiguous(memory_format=CL)
    assert model.head.weight.is_contiguous()

    out_on.float().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    assert model.conv1.weight.grad.is_contiguous(memory_format=CL)  # no layout copy


def _train_steps(model: nn.Module, forward, x: torch.Tensor, y: torch.Tensor, steps: int = 3
                 ) -> Tuple[List[float], List[Dict[str, torch.Tensor]], List[tuple]]:
    """``steps`` SGD steps of ``model`` through ``forward``; the losses, each step's gradients
    and what the convolutions saw (:class:`_ConvInputs`)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads, seen = [], [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with _ConvInputs() as mode:
            loss = F.cross_entropy(forward(x).float(), y)  # the loss in FP32, outside autocast
            loss.backward()
        seen += mode.seen
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, seen


_TRAINED = {
    "tiny_convnet": (TinyConvNet, (4, 3, 16, 16)),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (4, 3, 64, 64)),
}


@pytest.mark.parametrize("name", ["tiny_convnet", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_channels_last_training_equals_autocast_training_in_channels_last(name):
    """fxamp ``channels_last=on`` training equals ``torch.autocast`` training of the same model
    in NHWC (``model.to(memory_format=torch.channels_last)``, NHWC inputs): the same losses,
    gradients and parameters, bit for bit. Both sides use the same kernels, so no tolerance:
    NCHW is not compared with NHWC (their bf16 kernels round differently on some CPUs)."""
    torch.manual_seed(0)
    make, shape = _TRAINED[name]
    base = make().train()
    x = torch.randn(*shape)
    y = torch.randint(0, 10, (shape[0],))

    model = copy.deepcopy(base)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                    policy="channels_last=on"))
    assert gm.conv1.weight is model.conv1.weight
    losses, grads, seen = _train_steps(model, gm, x, y)  # NCHW input: gm converts it

    reference = copy.deepcopy(base).to(memory_format=CL)

    def autocast_forward(inp: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return reference(inp.contiguous(memory_format=CL))

    ref_losses, ref_grads, ref_seen = _train_steps(reference, autocast_forward, x, y)

    # every convolution of both runs gets an NHWC input and weight in bf16
    assert len(seen) == len(ref_seen) > 0
    assert all(inp and weight and dtype == BF16 for inp, weight, dtype in seen), seen
    assert all(inp and weight and dtype == BF16 for inp, weight, dtype in ref_seen), ref_seen
    assert losses[-1] < losses[0]  # it learns
    assert losses == ref_losses
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == torch.float32, (step, name)
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0,
                                       msg=lambda m: f"step {step}, {name}.grad: {m}")
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        if p.dim() == 4:
            assert p.is_contiguous(memory_format=CL) and p.grad.is_contiguous(memory_format=CL)
    for name, buf in reference.named_buffers():  # BatchNorm running statistics
        torch.testing.assert_close(model.get_buffer(name), buf, rtol=0, atol=0)


def test_model_without_conv_gets_a_note_and_no_change(caplog):
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 4))
    x = torch.randn(2, 3, 4, 4)
    with caplog.at_level(logging.INFO, logger="fxamp"):
        gm = fxamp.amp_rewrite(model, (x,),
                               fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                        policy="channels_last=on"))
    assert "no 2-D convolution" in caplog.text
    assert "channels_last" not in gm.code
    off = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    assert gm.code == off.code
    torch.testing.assert_close(gm(x), off(x))


@pytest.mark.slow
def test_torch_compile_of_the_channels_last_rewrite():
    torch.manual_seed(0)
    model = TinyConvNet().train()
    x = torch.randn(2, 3, 16, 16)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                    policy="channels_last=on"))
    eager = gm(x)
    out = torch.compile(gm)(x)
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert model.conv1.weight.grad.dtype == torch.float32


def test_channels_last_with_the_export_front_end():
    torch.manual_seed(0)
    model = TinyConvNet().train()
    x = torch.randn(2, 3, 16, 16)
    off = fxamp.amp_rewrite(model, (x,),
                            fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend="export"))
    on = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend="export",
                                                    policy="channels_last=on"))
    assert fxamp.plan_of(on).header["frontend"] == "export"
    with _ConvInputs() as mode:
        out = on(x)
    assert len(mode.seen) == 3 and all(inp and weight for inp, weight, _ in mode.seen)
    torch.testing.assert_close(out, off(x), rtol=2e-2, atol=2e-2)
    assert model.conv1.weight.is_contiguous(memory_format=CL)
