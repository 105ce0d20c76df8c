"""Dtypes the model reads at run time follow autocast's run on the torch.export front end.

torch.export traces in FP32, so ``.to(h.dtype)``, ``.to(x.device)`` (whose dtype the export
fills in) and ``torch.finfo(scores.dtype).min`` would be frozen at FP32's values; under
autocast the same code sees bf16. Each model here trains one step and runs in eval next to
``torch.autocast``, and must equal it bit for bit.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import fxamp


class _Reads(nn.Module):
    """Every kind of run-time dtype read, on values autocast makes bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("cos", torch.randn(16))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        h = h * self.cos.to(h.dtype) + self.cos.type_as(h)       # rotary-style tables
        pos = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.norm(h + pos.to(x.device))                      # to(device): dtype filled in
        scores = h @ self.k(h).transpose(1, 2)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        return self.out(scores.softmax(-1) @ h)


def _inputs():
    torch.manual_seed(0)
    mask = torch.zeros(2, 1, 6, dtype=torch.bool)
    mask[1, :, 4:] = True
    return torch.randn(2, 6, 16), mask


def _step(model: nn.Module, args: tuple, kwargs: dict, autocast: bool):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # (dropout draws the same masks on both sides)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = model(*args, **kwargs)
    out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _eval(model: nn.Module, args: tuple, kwargs: dict, autocast: bool) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = model(*args, **kwargs)
    return (out if isinstance(out, torch.Tensor) else out.last_hidden_state).float()


def _assert_like_autocast(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """One training step and one eval forward of the export rewrite equal autocast's."""
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, args,
                      fxamp.RewriteConfig.make(example_kwargs=kwargs, dtype=torch.bfloat16,
                                               target="cpu",
                                               frontend="export"), inplace=True)
    loss_ref, grads_ref = _step(ref, args, kwargs, True)
    loss, grads = _step(model, args, kwargs, False)
    assert torch.equal(loss, loss_ref), (loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    differ = [n for n in grads if not torch.equal(grads[n], grads_ref[n])]
    assert not differ, differ
    assert torch.equal(_eval(model, args, kwargs, False), _eval(ref, args, kwargs, True))


def test_dtype_reads_in_a_handwritten_model_train_and_eval_like_autocast():
    x, mask = _inputs()
    _assert_like_autocast(_Reads(), (x, mask), {})


def test_to_the_dtype_of_a_bf16_value_is_planned_bf16():
    x, mask = _inputs()
    gm = fxamp.amp_rewrite(_Reads(), (x, mask),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                    frontend="export"))
    plan = fxamp.plan_of(gm)
    casts = {name: rec.dtype for name, rec in plan.nodes.items()
             if rec.op in ("aten.to.dtype", "aten.to.dtype_layout")}
    assert casts and set(casts.values()) == {torch.bfloat16}, casts


def test_finfo_min_of_a_bf16_tensor_is_filled_as_under_autocast():
    """FP32's minimum cannot be written into bf16 scores: the rewrite used to raise."""
    x, mask = _inputs()
    gm = fxamp.amp_rewrite(_Reads(), (x, mask),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                    frontend="export"))
    fills = [n for n in gm.graph.nodes if n.target is torch.ops.aten.masked_fill.Scalar]
    assert [n.args[2] for n in fills] == [torch.finfo(torch.bfloat16).min]


class _Branches(nn.Module):
    """Code that runs other ops for another dtype: no graph can follow both."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.dtype == torch.float32:
            h = h.to(torch.float32).relu()
        return h.sum(-1)


def test_a_branch_on_a_dtype_warns_naming_the_line(caplog):
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        fxamp.amp_rewrite(_Branches(), (torch.randn(2, 8),),
                          fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                   frontend="export"))
    text = " ".join(r.getMessage() for r in caplog.records if "branches on a dtype" in
                    r.getMessage())
    assert "test_dtype_reads.py" in text and "relu" in text, caplog.text


@pytest.mark.slow
def test_hf_deberta_v2_attention_mask_trains_like_autocast():
    """``masked_fill(..., finfo(scores.dtype).min)`` on bf16 scores (it used to raise)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, relative_attention=True,
        pos_att_type=["p2c", "c2p"], max_relative_positions=32)
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    _assert_like_autocast(transformers.DebertaV2Model(cfg), (ids,), {"attention_mask": mask})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_vit_88m", "naflexvit_base_patch16_gap"])
def test_timm_rotary_and_pooler_dtype_reads_train_like_autocast(name):
    """``cos.to(x.dtype)`` / ``.type_as(h)`` on a Linear's bf16 output."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=32, depth=1, embed_dim=64,
                              num_heads=2)
    _assert_like_autocast(model, (torch.randn(2, 3, 32, 32),), {})


# -- conversions settled by one eager run under autocast (frontends/dtype_probe.py) ----------

def _eval_like_autocast(model: nn.Module, args: tuple, export_calls: list) -> int:
    """Rewrite ``model`` (eval, export front end) and check its eval forward equals
    autocast's bit for bit; returns how many times torch.export ran for the rewrite."""
    ref = copy.deepcopy(model).eval()
    model.eval()
    gm = fxamp.amp_rewrite(model, args, fxamp.RewriteConfig.make(
        dtype=torch.bfloat16, target="cpu", frontend="export"))
    calls = len(export_calls)
    with torch.no_grad():
        got = gm(*args)
        with torch.autocast("cpu", torch.bfloat16):
            want = ref(*args)
    assert torch.equal(got.float(), want.float())  # (the rewrite returns FP32 outputs)
    return calls


class _RMSNorm(nn.Module):
    """T5's norm: literal FP32 conversions, and a bucket computed from integer positions."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.weight = nn.Linear(8, 8), nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.lin(x)
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        pos = torch.arange(x.shape[1]).float().log1p()
        return self.weight * h + pos[:, None]


def test_literal_fp32_conversions_need_no_export_under_autocast(export_calls):
    assert _eval_like_autocast(_RMSNorm(), (torch.randn(2, 5, 8),), export_calls) == 1


class _ToValueDtype(nn.Module):
    """GPT-2's ``softmax(...).to(value.dtype)``: the conversion reaches a matmul only,
    through ops that pass it on (a dropout in eval, a view)."""

    def __init__(self, dropout: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.drop = nn.Dropout(0.1) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        weights = (q @ k.transpose(-1, -2)).softmax(-1).to(v.dtype)
        return self.drop(weights).transpose(-1, -2).contiguous().transpose(-1, -2) @ v


def test_a_conversion_reaching_only_a_matmul_needs_no_export_under_autocast(export_calls):
    assert _eval_like_autocast(_ToValueDtype(), (torch.randn(2, 5, 8),), export_calls) == 1


def test_that_conversion_in_training_mode_still_trains_like_autocast():
    """In training the dropout scales what it keeps, so the export under autocast decides."""
    _assert_like_autocast(_ToValueDtype(dropout=True), (torch.randn(2, 5, 8),), {})


class _TableToDtype(nn.Module):
    """A conversion autocast makes bf16 that feeds an add: the eager run shows it differs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + self.table.to(h.dtype)


def test_a_conversion_to_a_bf16_dtype_is_still_exported_under_autocast(export_calls):
    assert _eval_like_autocast(_TableToDtype(), (torch.randn(2, 8),), export_calls) == 2


class _CountsCalls(nn.Module):
    """Writes a buffer on every call: an eager run would change the model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x).to(torch.float32).relu()


def test_no_eager_run_for_a_model_that_writes_a_buffer(export_calls):
    model = _CountsCalls().eval()
    fxamp.amp_rewrite(model, (torch.randn(2, 8),), fxamp.RewriteConfig.make(
        dtype=torch.bfloat16, target="cpu", frontend="export"), inplace=True)
    assert len(export_calls) == 2  # (the export under autocast, not an eager run, decides)
    assert model.calls.item() == 0
