"""fxamp's plan against PyTorch's own autocast test lists, every entry in every spelling.

For each entry of ``AutocastCPUTestLists`` (CPU bf16 and fp16) and ``AutocastTestLists``
(CUDA fp16, on fake CUDA tensors) and each spelling of its op, a one-op module is rewritten
with ``rule=autocast`` only (numerics passes and cast placement off):

* every node's planned dtype equals the dtype real autocast gives it;
* ops autocast bans (it raises) are refused with fxamp's UnsupportedModelError, naming the
  ``*_with_logits`` fix;
* on CPU the rewritten module's output is bit-identical to the original's under autocast.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx

import fxamp
from autocast_list_cases import (CASES, Case, all_cases, equal, fake_cuda_received_dtypes,
                                 output_dtypes, run_autocast)
from autocast_truth import autocast_rewrite, record_autocast_dtypes

# the lists' arguments use deprecated forms (size_average, chain_matmul...): torch warns
pytestmark = [pytest.mark.floor, pytest.mark.filterwarnings("ignore::UserWarning")]

#: what autocast's error says for an op it refuses (binary_cross_entropy)
BANNED = "unsafe to autocast"

ALL = [case for target, dtype in CASES for case in all_cases(target, dtype)]


def _each_entry_once_fast(cases: list) -> list:
    """The cases as parameters; an entry's spellings after its first are marked slow, so the
    fast tier (``-m "not slow"``) checks every entry once and the full suite every spelling."""
    seen, params = set(), []
    for case in cases:
        marks = pytest.mark.slow if id(case.entry) in seen else ()
        seen.add(id(case.entry))
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def check_case(case: Case, device: str = "cpu") -> None:
    """Rewrite ``case``'s module and compare the plan (and on CPU or a real GPU, the
    output) with real autocast. ``device``: where the module and inputs live ("cuda" on a
    GPU machine; the plan of a "cuda" target is then observed on real CUDA tensors)."""
    target, dtype = case.entry.target, case.entry.dtype
    model, inputs = case.build()
    model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    try:
        traced = torch.fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001 - e.g. x.__div__(y): torch.fx cannot trace it
        traced = None  # fxamp takes it with torch.export; compare the op's output dtype
    try:
        if traced is not None:
            truth = record_autocast_dtypes(traced, inputs, target, dtype)
        else:
            out = run_autocast(model, inputs, target, dtype, device=device)
            truth = {"(the op)": next((d for d in output_dtypes(out) if d.is_floating_point),
                                      None)}
    except RuntimeError as err:
        if BANNED not in str(err):
            if target != "cuda" or device == "cuda" or traced is None:
                raise
            # fake CUDA kernels cannot run it (cudnn_convolution, gru_cell's fused kernel):
            # the dtype autocast hands the op is the truth
            truth = fake_cuda_received_dtypes(traced, inputs, dtype)
        else:
            with pytest.raises(fxamp.errors.UnsupportedModelError, match="_with_logits"):
                autocast_rewrite(model, inputs, dtype=dtype, target=target)
            return
    gm = autocast_rewrite(model, inputs, dtype=dtype, target=target)
    plan = fxamp.plan_of(gm)
    if traced is None:  # the op's node is the plan's last; autocast's output dtype its truth
        op_dtype = truth["(the op)"]
        truth = {list(plan.nodes)[-1]: op_dtype} if op_dtype is not None else {}
    got = {name: plan.nodes[name].dtype if name in plan.nodes else None for name in truth}
    wrong = {name: (got[name], want) for name, want in truth.items() if got[name] != want}
    assert not wrong, f"{case.id}: planned vs autocast dtype {_describe(wrong, plan)}"
    if target == device:
        expected = run_autocast(model, inputs, target, dtype, device=device)
        with torch.no_grad():
            out = gm(*inputs)
        if device == "cpu":
            assert equal(out, expected), (
                f"{case.id}: output {output_dtypes(out)} is not bit-identical to autocast's "
                f"{output_dtypes(expected)}")
        else:  # GPU kernels with atomics (scatter_add, index_put) need not be bitwise
            assert output_dtypes(out) == output_dtypes(expected)
            torch.testing.assert_close(out, expected)


def _describe(wrong: dict, plan: fxamp.Plan) -> str:
    """``node planned!=autocast (reason)`` for each node whose dtype differs."""
    parts = []
    for name, (planned, want) in wrong.items():
        reason = plan.nodes[name].reason if name in plan.nodes else "not in the plan"
        parts.append(f"{name} {_short(planned)}!={_short(want)} ({reason})")
    return "; ".join(parts)


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "")


@pytest.mark.parametrize("case", _each_entry_once_fast(ALL))
def test_plan_is_what_autocast_does(case: Case) -> None:
    check_case(case)


def test_lists_cover_every_spelling_kind() -> None:
    """The cases reach the op through each kind of spelling the issue names, for each
    (target, dtype), and include autocast's banned op and a CUDA-only op."""
    for target, dtype in CASES:
        labels = {c.label for c in ALL if (c.entry.target, c.entry.dtype) == (target, dtype)}
        for prefix in ("torch.", "torch._C._nn.", "torch._VF.", "F.", "Tensor."):
            assert any(label.startswith(prefix) for label in labels), (target, dtype, prefix)
    cuda = {c.label for c in ALL if c.entry.target == "cuda"}
    assert {"torch.linalg.vecdot", "torch._C._nn.binary_cross_entropy",
            "torch.cudnn_convolution"} <= cuda
