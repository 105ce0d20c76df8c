"""Ops on autocast's FP32 lists get their plan line and their cast whatever their spelling.

``torch.fft.*`` (complex outputs), ``torch.linalg.*`` with complex or integer outputs, the
``torch.special`` names, Tensor methods and ATen overloads: real ``torch.autocast`` on the
same machine is the oracle. An override that matches such a node takes effect.
"""
import pytest
import torch
import torch.nn as nn

import fxamp
from autocast_list_cases import run_autocast
from autocast_truth import autocast_rewrite

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


class After(nn.Module):
    """``fn(self.a(x))``: the op gets the low-precision output of a Linear."""

    def __init__(self, fn, width=8):
        super().__init__()
        self.a = nn.Linear(8, width)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.a(x))


def _abs(fn):
    return lambda h: fn(h).abs()


SPELLINGS = {
    "torch.fft.rfft": _abs(torch.fft.rfft),
    "torch.fft.fft": _abs(torch.fft.fft),
    "torch.fft.ifft2": _abs(torch.fft.ifft2),
    "torch.fft.ihfft": _abs(torch.fft.ihfft),
    "Tensor.stft": _abs(lambda h: h.stft(4, return_complex=True)),
    "aten.fft_rfft": _abs(lambda h: torch.ops.aten.fft_rfft.default(h)),
    "torch.polar": _abs(lambda h: torch.polar(h, h)),
    "torch.linalg.eigvals": _abs(torch.linalg.eigvals),
    "torch.linalg.matrix_rank": lambda h: torch.linalg.matrix_rank(h) * h,
    "torch.linalg.polar": lambda h: torch.linalg.polar(h)[0],
}


def _eq(a, b):
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_rfft_gets_its_plan_line_and_its_fp32_cast_like_cpu_autocast(frontend):
    model = After(_abs(torch.fft.rfft)).eval()
    gm = fxamp.amp_rewrite(model, (X,),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                    frontend=frontend))
    plan = fxamp.plan_of(gm)
    line = plan.nodes["fft_rfft"]
    assert (line.dtype, line.inputs, line.rule) == (torch.float32, torch.float32, "autocast")
    assert "fft_rfft is on autocast's fp32 list for cpu" in line.reason
    if frontend == "fx":
        assert line.op == "torch.fft.rfft"
    with torch.no_grad():
        out = gm(X)  # was: NotImplementedError: Unsupported dtype BFloat16
    assert _eq(out, run_autocast(model, (X,), "cpu", torch.bfloat16))


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_each_spelling_computes_what_cpu_autocast_computes(name):
    model = After(SPELLINGS[name], 4 if "linalg" in name else 8).eval()  # 4x4: square
    want = run_autocast(model, (X,), "cpu", torch.bfloat16)
    gm = autocast_rewrite(model, (X,), dtype=torch.bfloat16, target="cpu")
    with torch.no_grad():
        got = gm(X)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fn,op", [(lambda h: torch.special.softmax(h, 0), "special_softmax"),
                                   (lambda h: torch.special.log_softmax(h, 0),
                                    "special_log_softmax"),
                                   (torch.linalg.norm, "linalg_norm")])
def test_aten_aliases_of_listed_ops_get_explicit_fp32_casts_for_cuda(fn, op):
    model = After(fn).eval()
    want = run_autocast(model, (X,), "cuda", torch.float16)  # fake CUDA tensors
    gm = fxamp.amp_rewrite(model, (X,),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda",
                                                    frontend="export"))
    line = fxamp.plan_of(gm).nodes[op]
    # was rule "runtime": autocast of whatever device it runs on (CPU's lists lower it)
    assert (line.dtype, line.inputs, line.rule) == (want.dtype, torch.float32, "autocast")
    with torch.no_grad():
        assert gm(X).dtype == torch.float32


def test_an_override_on_an_fft_takes_effect():
    model = After(_abs(torch.fft.rfft)).eval()
    # CUDA's lists leave the FFT to its inputs (fp16); the override keeps it in fp32
    gm = fxamp.amp_rewrite(model, (X,),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda",
                                                    policy="fp32:fft_rfft"))
    line = fxamp.plan_of(gm).nodes["fft_rfft"]
    assert (line.dtype, line.inputs, line.rule) == (torch.float32, torch.float32, "user")
    with torch.no_grad():
        out = gm(X)  # was: NotImplementedError: Unsupported dtype Half (no cast made)
    assert out.dtype == torch.float32


def test_an_override_that_matches_no_fft_is_still_refused():
    model = After(_abs(torch.fft.rfft)).eval()
    with pytest.raises(fxamp.PolicyError, match="fft_rfft"):
        fxamp.amp_rewrite(model, (X,),
                          fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                   policy="fp32:fft_irfft"))


class Indices(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h * h.size(0) + h.argmax(-1, keepdim=True)


def test_an_override_on_an_op_with_an_integer_output_takes_effect():
    gm = fxamp.amp_rewrite(Indices(), (X,),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                    policy="fp32:argmax"))
    line = fxamp.plan_of(gm).nodes["argmax"]  # was: no line, the override did nothing
    assert (line.dtype, line.inputs, line.rule) == (torch.float32, torch.float32, "user")
    assert "argmax_fp32" not in gm.code and "a_fp32 = a.to(torch.float32)" in gm.code


def test_an_override_that_matches_only_a_size_is_refused():
    with pytest.raises(fxamp.PolicyError, match="'fp32:size' matches only nodes with no "
                                                "floating-point input or output"):
        fxamp.amp_rewrite(Indices(), (X,),
                          fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                   policy="fp32:size"))
