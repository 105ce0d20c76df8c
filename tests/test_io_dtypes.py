"""Inputs and outputs keep the model's dtypes: an input the FP32 model and autocast would not
convert is refused instead of cast silently, and an output the model converts itself keeps
its dtype under the default ``output=fp32``. Compared with the model under torch.autocast."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import InputDtypeError

BF16 = dict(dtype=torch.bfloat16, target="cpu")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ mask


class Converts(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.how = nn.Linear(8, 4), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.how == "half":
            return y.half()
        if self.how == "fp8":
            return y.to(torch.float8_e4m3fn)
        return y.to(torch.bfloat16)


def _autocast(model, *args):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*args)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("bad", [torch.int64, torch.bool, torch.float64])
def test_an_input_autocast_would_not_convert_is_refused_not_cast(bad, inplace):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 8)
    y = (torch.randn(2, 8) * 3).to(bad)
    for run in (lambda: model(y), lambda: _autocast(model, y)):
        with pytest.raises(RuntimeError):  # the FP32 model and autocast refuse it too
            run()
    gm = fxamp.amp_rewrite(model, (x,), inplace=inplace, **BF16)
    with pytest.raises(InputDtypeError, match=rf"input 'x' is a {bad}"):
        gm(y)
    assert torch.equal(gm(x), _autocast(model, x).float())  # the planned dtype still runs


def test_a_float64_mask_next_to_a_float32_input_is_refused():
    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(2, 8), torch.randn(8, 8)
    with pytest.raises(RuntimeError):
        _autocast(model, x, mask.double())
    gm = fxamp.amp_rewrite(model, (x, mask), **BF16)
    with pytest.raises(InputDtypeError, match="input 'mask' is a torch.float64"):
        gm(x, mask.double())
    # a half input is what autocast casts too: it runs, equal to autocast
    assert torch.equal(gm(x.half(), mask), _autocast(model, x.half(), mask).float())


@pytest.mark.parametrize("how,dtype", [("half", torch.float16), ("fp8", torch.float8_e4m3fn),
                                       ("bf16", torch.bfloat16)])
def test_an_output_the_model_converts_keeps_its_dtype(how, dtype):
    torch.manual_seed(0)
    model, x = Converts(how), torch.randn(2, 8)
    gm = fxamp.amp_rewrite(model, (x,), **BF16)
    out, want = gm(x), _autocast(model, x)
    assert out.dtype == want.dtype == dtype
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_a_low_precision_output_the_plan_made_is_fp32():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 8)
    gm = fxamp.amp_rewrite(model, (x,), **BF16)
    assert gm(x).dtype == torch.float32 and _autocast(model, x).dtype == torch.bfloat16
