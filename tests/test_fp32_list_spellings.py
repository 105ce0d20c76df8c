"""Every op on autocast's FP32 lists, in every spelling, against real autocast.

For each op name on the CPU and CUDA fp32 tables (``fp32`` and ``fp32_opt``) the spellings
are found by name: ``torch.X``, ``F.X``, ``torch.fft.X`` / ``torch.linalg.X`` /
``torch.special.X`` (with and without the ``fft_`` / ``linalg_`` / ``special_`` prefix),
the Tensor method and the ATen overload. The first argument pattern the op takes in fp32 is
used in ``op(linear(x), ...)``; the rewritten module's output dtypes must be autocast's
(CPU for real, CUDA on fake tensors). torch.export front end: the torch-level spellings.
A model torch.export cannot take (``geqrf``, ``linalg.lstsq``) must be refused loudly.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import ops
from autocast_list_cases import run_autocast
from autocast_truth import autocast_rewrite

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

#: argument patterns after the first: "H" is the Linear's output again (detached), "I" an
#: integer tensor
PATTERNS = [(), (0,), (-1,), (2,), (0.5,), (2, 0, 1.0), ("H",), ("H", "H"), (1, 0.5), ("I",),
            ("H", 0.5)]
KWARGS = {"stft": {"n_fft": 4, "return_complex": True}}
TARGETS = (("cpu", torch.bfloat16), ("cuda", torch.float16))


class OpAfterLinear(nn.Module):
    def __init__(self, call: Callable[..., Any], extra: tuple) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.call, self.extra = call, extra

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        extra = tuple(h.detach() if e == "H" else torch.ones(4, dtype=torch.long) if e == "I"
                      else e for e in self.extra)
        return self.call(h, *extra)


def _dtypes(value: Any) -> List[torch.dtype]:
    if isinstance(value, torch.Tensor):
        return [value.dtype]
    if isinstance(value, (list, tuple)):
        return [d for v in value for d in _dtypes(v)]
    return []


def _method(name: str) -> Callable[..., Any]:
    return lambda h, *a, **k: getattr(h, name)(*a, **k)


def _spellings(base: str) -> List[Tuple[str, Callable[..., Any]]]:
    found = []
    for prefix, ns in (("fft_", torch.fft), ("linalg_", torch.linalg),
                       ("special_", torch.special)):
        if base.startswith(prefix) and callable(getattr(ns, base[len(prefix):], None)):
            found.append((f"{ns.__name__}.{base[len(prefix):]}", getattr(ns, base[len(prefix):])))
    for ns in (torch, F, torch.special, torch.linalg, torch.fft):
        fn = getattr(ns, base, None)
        if callable(fn) and not isinstance(fn, type):
            found.append((f"{ns.__name__}.{base}", fn))
    if hasattr(torch.Tensor, base) and not base.startswith("_"):
        found.append((f"Tensor.{base}", _method(base)))
    return found


def _aten(name: str) -> List[Tuple[str, Callable[..., Any]]]:
    base, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, base, None), overload or "default", None)
    return [(f"aten.{name}", op)] if op is not None else []


def _model(label: str, fn: Callable[..., Any]) -> Any:
    kwargs = KWARGS.get(label.rsplit(".", 1)[-1], {})
    for extra in PATTERNS:
        model = OpAfterLinear(lambda h, *a, f=fn: f(h, *a, **kwargs), extra).eval()
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = model(torch.randn(4, 4))
        except Exception:  # noqa: BLE001 - another argument pattern
            continue
        if _dtypes(out):
            return model
    return None


def _cases() -> list:
    cases, seen = [], set()
    for target, dtype in TARGETS:
        names = sorted(n for n in ops.fp32_list_ops(target))
        spelled = [s for b in sorted({n.split(".")[0] for n in names}) for s in _spellings(b)]
        spelled += [s for n in names for s in _aten(n)]
        for label, fn in spelled:
            if (target, label) in seen:
                continue
            seen.add((target, label))
            if _model(label, fn) is None:  # (no argument pattern of this probe fits the op)
                continue
            frontends = ["fx", "export"] if label.startswith(("torch.", "Tensor.")) else ["fx"]
            if target == "cuda":
                frontends = ["fx"]  # a cuda plan runs here on the CPU: runtime calls differ
            for frontend in frontends:
                cases.append(pytest.param(target, dtype, label, fn, frontend,
                                          id=f"{target}-{frontend}-{label}"))
    return cases


@pytest.mark.parametrize("target,dtype,label,fn,frontend", _cases())
def test_output_dtypes_are_autocasts(target, dtype, label, fn, frontend):
    model = _model(label, fn)
    assert model is not None  # (collected only where a pattern fits)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    try:
        want = _dtypes(run_autocast(model, (x,), target, dtype))
    except Exception as err:  # noqa: BLE001 - e.g. no fake CUDA kernel
        if target != "cuda":
            raise  # (on the CPU autocast runs every probe that fits)
        pytest.skip(f"needs a CUDA GPU: autocast on fake CUDA tensors raises "
                    f"{type(err).__name__}")
    try:
        gm = autocast_rewrite(model, (x,), dtype=dtype, target=target, frontend=frontend)
    except fxamp.TraceError as err:  # refused loudly: torch.export cannot take the op
        assert frontend == "export" and "torch.export cannot export" in str(err)
        return
    with torch.no_grad():
        got = _dtypes(gm(x))
    assert got == want, f"{label}: {got} != autocast's {want}\n{fxamp.plan_of(gm).to_text()}"
