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
    gm = fxamp.amp_rewrite(model, (x,), inplace=inplace, config=fxamp.RewriteConfig.make(**BF16))
    with pytest.raises(InputDtypeError, match=rf"input 'x' is a {bad}"):
        gm(y)
    assert torch.equal(gm(x), _autocast(model, x).float())  # the planned dtype still runs


def test_a_float64_mask_next_to_a_float32_input_is_refused():
    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(2, 8), torch.randn(8, 8)
    with pytest.raises(RuntimeError):
        _autocast(model, x, mask.double())
    gm = fxamp.amp_rewrite(model, (x, mask), fxamp.RewriteConfig.make(**BF16))
    with pytest.raises(InputDtypeError, match="input 'mask' is a torch.float64"):
        gm(x, mask.double())
    # a half input is what autocast casts too: it runs, equal to autocast
    assert torch.equal(gm(x.half(), mask), _autocast(model, x.half(), mask).float())


class ScaledByMask(nn.Module):
    """The mask reaches the linear through a product: the graph casts the product, not the
    mask itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x * mask)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_float64_mask_that_reaches_a_cast_through_an_op_is_refused(frontend):
    torch.manual_seed(0)
    model = ScaledByMask()
    x, mask = torch.randn(2, 8), torch.rand(2, 8)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        _autocast(model, x, mask.double())
    gm = fxamp.amp_rewrite(model, (x, mask), fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    with pytest.raises(InputDtypeError, match=r"input 'mask' is a torch.float64 tensor.*"
                                              r"what to do: pass mask as torch.float32"):
        gm(x, mask.double())
    # the planned dtype, and a half mask (which autocast casts too), run as under autocast
    assert torch.equal(gm(x, mask), _autocast(model, x, mask).float())
    assert torch.equal(gm(x, mask.half()), _autocast(model, x, mask.half()).float())


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_float32_mask_where_the_example_had_float64_is_refused(frontend):
    torch.manual_seed(0)
    model = ScaledByMask()
    x, mask = torch.randn(2, 8), torch.rand(2, 8)
    gm = fxamp.amp_rewrite(model, (x, mask.double()),
                           fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    # autocast casts the float32 product for the linear; the plan, made for a float64
    # product that autocast leaves alone, has no cast there
    want = _autocast(model, x, mask)
    assert want.dtype == torch.bfloat16
    with pytest.raises(InputDtypeError, match=r"input 'mask' is a torch.float32 tensor; the "
                                              r"rewrite was planned for a torch.float64"):
        gm(x, mask)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):  # as under autocast
        gm(x, mask.double())


@pytest.mark.parametrize("how,dtype", [("half", torch.float16), ("fp8", torch.float8_e4m3fn),
                                       ("bf16", torch.bfloat16)])
def test_an_output_the_model_converts_keeps_its_dtype(how, dtype):
    torch.manual_seed(0)
    model, x = Converts(how), torch.randn(2, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    out, want = gm(x), _autocast(model, x)
    assert out.dtype == want.dtype == dtype
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_a_low_precision_output_the_plan_made_is_fp32():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    assert gm(x).dtype == torch.float32 and _autocast(model, x).dtype == torch.bfloat16
