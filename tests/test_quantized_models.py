"""Quantized models are refused up front.

A model out of ``torch.ao.quantization``'s eager static or dynamic quantization, or out of
``quantize_fx``, computes on quantized integer tensors: fxamp plans floating-point models,
so it refuses such a model before tracing, naming the quantized module and saying to give
it the float model (the refusal was "fails with the planned dtypes" with ``fp32:`` advice
that failed the same way). The advice is followed: the float model, before quantization,
is rewritten and computes as under torch.autocast.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn as nn
from torch.ao.quantization import QConfigMapping, quantize_fx

import fxamp
from fxamp.errors import UnsupportedModelError

BF16 = dict(dtype=torch.bfloat16, target="cpu")


class Net(nn.Module):
    """A float model with eager quantization's stubs (identities until converted)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = tq.QuantStub()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.act(self.lin(self.quant(x))))


def _float_model() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


def _static(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    model.qconfig = tq.get_default_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = tq.prepare(model)
        prepared(torch.randn(16, 8))
        return tq.convert(prepared)


def _fx(model: nn.Module) -> nn.Module:
    mapping = QConfigMapping().set_global(tq.get_default_qconfig("fbgemm"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = quantize_fx.prepare_fx(copy.deepcopy(model), mapping, (torch.randn(2, 8),))
        prepared(torch.randn(16, 8))
        return quantize_fx.convert_fx(prepared)


def _dynamic(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tq.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)


QUANTIZERS = {
    "eager-static": (_static, "'lin' is torch.ao.nn.quantized.modules.linear.Linear"),
    "quantize_fx": (_fx, "LinearReLU"),
    "dynamic": (_dynamic, "'lin' is torch.ao.nn.quantized.dynamic"),
}


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_quantized_model_is_refused_naming_the_quantized_module(kind: str,
                                                                frontend: str) -> None:
    quantize, named = QUANTIZERS[kind]
    quantized = quantize(_float_model())
    x = torch.randn(2, 8)
    quantized(x)  # (it runs as it is)
    with pytest.raises(UnsupportedModelError) as info:
        fxamp.amp_rewrite(quantized, (x,), fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    text = str(info.value)
    assert "is quantized" in text and named in text
    assert "fxamp plans floating-point models" in text
    assert "fails with the planned dtypes" not in text and "fp32:" not in text
    assert "give amp_rewrite the floating-point model" in text


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_following_the_advice_the_float_model_rewrites_as_autocast_runs_it(
        frontend: str) -> None:
    model = _float_model()
    x = torch.randn(4, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    assert torch.equal(gm(x), expected.float())
    _static(model)(x)  # and the same float model is still the one to quantize
