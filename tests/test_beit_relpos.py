"""Hugging Face BEiT's relative position bias on the export front end (the returned module,
rewritten from an example) trains like the same model under torch.autocast, bit for bit.

Called without ``attention_mask``, transformers builds no mask in eager, but an all-True
boolean mask of the batch's size while torch.export runs; BEiT adds its bias table's
lookup to that mask, so the exported graph added 1.0 to the bias and broadcast it to the
batch before SDPA's cast: the tables' gradients were summed over the batch in FP32 where
autocast sums them in BF16 (off by up to 3% of the largest). fxamp exports with the
mask decided as in eager (``fxamp/frontends/mask_skips.py``)."""
from __future__ import annotations

import copy

import pytest
import torch

import fxamp

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")

BF16 = torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _beit(shared: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, image_size=32, patch_size=8,
                                  num_labels=3, use_relative_position_bias=not shared,
                                  use_shared_relative_position_bias=shared,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  drop_path_rate=0.0)
    model = transformers.BeitForImageClassification(cfg)
    with torch.no_grad():  # (HF initialises the tables to zeros: make them matter)
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_(0.0, 0.5)
    return model


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out["logits"]


def _train(model: torch.nn.Module, autocast: bool, batches: list) -> list:
    """Two SGD steps: each step's loss and every gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            logits = _logits(model(x))
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        steps.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                                      if p.grad is not None}))
        opt.step()
    return steps


@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "shared"])
def test_beit_relative_position_bias_trains_like_autocast(shared):
    model = _beit(shared)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 3, (b,), generator=g))
               for b in (2, 3)]
    helper = vars(masking_utils).get("_ignore_bidirectional_mask_sdpa")
    gm = fxamp.amp_rewrite(copy.deepcopy(model), (batches[0][0],),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                    frontend="export"))
    assert vars(masking_utils).get("_ignore_bidirectional_mask_sdpa") is helper  # put back
    ref = _train(model, True, batches)
    got = _train(gm, False, batches)
    tables = {k for k in ref[0][1] if k.endswith("relative_position_bias_table")}
    assert len(tables) == (1 if shared else 2)
    for (loss_ref, grads_ref), (loss, grads) in zip(ref, got):
        assert torch.equal(loss, loss_ref)
        assert set(grads) == set(grads_ref) and tables <= set(grads)
        off = {k: (grads[k] - grads_ref[k]).abs().max().item()
               for k in grads_ref if not torch.equal(grads[k], grads_ref[k])}
        assert not off, off
