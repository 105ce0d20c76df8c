"""The plan is authoritative at run time: a ``torch.autocast`` around the rewritten model
(a user's own, Lightning's ``bf16-mixed``, accelerate's ``mixed_precision``) changes nothing
it computes, is reported once, and is back on after the call (fxamp.program.Program)."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import program

BF16 = torch.bfloat16
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 2, 1, 0])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.fixture(autouse=True)
def _warn_again(monkeypatch):
    monkeypatch.setattr(program, "_WARNED", [])


def test_an_fp32_override_holds_under_an_outer_autocast_and_is_reported_once(caplog):
    gm = fxamp.amp_rewrite(_mlp(), (X,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:0"))
    want = gm(X)
    with caplog.at_level(logging.WARNING, logger="fxamp.program"):
        with torch.autocast("cpu", dtype=BF16):
            got = gm(X)
            again = gm(X)
            assert torch.is_autocast_enabled("cpu")  # back on after each call
    assert not torch.is_autocast_enabled("cpu")
    assert torch.equal(got, want) and torch.equal(again, want)
    assert caplog.text.count("turned off inside it") == 1
    # the fp32 layer really computed in FP32: under autocast it would not match
    with torch.autocast("cpu", dtype=BF16):
        assert not torch.equal(_mlp()(X).float(), want)


def test_gradients_under_an_outer_autocast_equal_those_without():
    grads = []
    for outer in (False, True):
        model = _mlp()
        gm = fxamp.amp_rewrite(model, (X,),
                               fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:2"))
        with torch.autocast("cpu", dtype=BF16, enabled=outer):
            loss = F.cross_entropy(gm(X).float(), Y)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_compiled_rewrite_under_an_outer_autocast_computes_the_plan():
    gm = fxamp.amp_rewrite(_mlp(), (X,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:0"))
    want = gm(X)
    compiled = torch.compile(gm, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=BF16):
        got = compiled(X)
        assert torch.is_autocast_enabled("cpu")
    assert torch.equal(got, want)


def test_an_eager_root_s_own_autocast_is_not_reported(caplog):
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if float(h.sum()) > 1e9:  # data-dependent: no tracer takes the root
                h = h * 2
            return self.b(h)

    torch.manual_seed(0)
    model = Root()
    gm = fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    with caplog.at_level(logging.WARNING, logger="fxamp.program"):
        gm(X)
    assert "turned off inside it" not in caplog.text


@pytest.mark.slow
def test_lightning_bf16_mixed_trains_the_rewritten_model_like_precision_32(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    class Lit(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            self.losses: list = []

        def training_step(self, batch, idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=4)
    ref = _mlp()
    runs = {}
    for name, precision, rewrite in (("fxamp bf16-mixed", "bf16-mixed", True),
                                     ("fxamp 32", "32", True),
                                     ("autocast bf16-mixed", "bf16-mixed", False)):
        net = copy.deepcopy(ref)
        if rewrite:
            fxamp.amp_rewrite(net, (X,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                              inplace=True)
        lit = Lit(net)
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=4,
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(tmp_path))
        trainer.fit(lit, data)
        runs[name] = (lit.losses, [p.detach().clone() for p in net.parameters()])
    assert len(runs["fxamp 32"][0]) == 4
    assert runs["autocast bf16-mixed"][0][-1] < runs["autocast bf16-mixed"][0][0]
    for name in ("fxamp bf16-mixed", "autocast bf16-mixed"):
        assert runs[name][0] == runs["fxamp 32"][0], name
        assert all(torch.equal(p, q) for p, q in zip(runs[name][1], runs["fxamp 32"][1]))
