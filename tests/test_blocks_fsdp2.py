"""FSDP2 per decoder layer (torch.distributed, gloo, 2 processes): the recipe of torchtitan,
accelerate's FSDP2 plugin and Lightning's ModelParallelStrategy (``fully_shard`` of each
layer, then of the root) after ``amp_rewrite(model, inplace=True)`` without example inputs,
or with them (planned then on the example), or the module it returns with
``inplace=False`` and ``partition="blocks"`` (a twin of the model keeping its tree), trains
exactly like
the same recipe under torch.autocast, with and without HF gradient checkpointing (rewriter/blocks.py: each layer stays a module, so FSDP2's hooks on it run)."""
from __future__ import annotations

import copy

import pytest
import torch
from _spawned import run_spawned

BF16 = torch.bfloat16
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


def _llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def _train(model, ids, autocast: bool) -> tuple:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = [p.full_tensor() for p in model.parameters()]
    return losses, [p.detach().clone() for p in full]


def _per_layer(rank: int, checkpointing: bool, example: bool = False,
               returned: bool = False) -> list:
    import fxamp
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    ref = _llama()
    model = copy.deepcopy(ref)
    if returned:  # (the returned twin, its layers modules: partition="blocks")
        model = fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(
            dtype=BF16, target="cpu", partition="blocks"))
    elif example:  # (planned now, on the example, with the default partition)
        fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                          inplace=True)
    else:
        fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                          inplace=True)
    for m in (model, ref):
        if checkpointing:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
    (losses, params), (ref_losses, ref_params) = _train(model, ids, False), \
        _train(ref, ids, True)
    return [losses == ref_losses and ref_losses[-1] < ref_losses[0],
            all(torch.equal(p, q) for p, q in zip(params, ref_params)),
            fxamp.plan_of(model).header["frontend"]]


def _both(rank: int) -> dict:
    return {"plain": _per_layer(rank, False), "checkpointing": _per_layer(rank, True),
            "example": _per_layer(rank, False, True),
            "example, checkpointing": _per_layer(rank, True, True),
            "returned": _per_layer(rank, False, returned=True),
            "returned, checkpointing": _per_layer(rank, True, returned=True)}


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("transformers")
    return run_spawned(_both)


@pytest.mark.parametrize("how", ["plain", "checkpointing", "example",
                                 "example, checkpointing", "returned",
                                 "returned, checkpointing"])
def test_fully_shard_per_decoder_layer_trains_like_fsdp2_with_autocast(results, how):
    for rank in (0, 1):
        assert results[rank][how] == [True, True, "blocks"], (rank, results[rank][how])


def _traced_glue(rank: int) -> list:
    """A model whose own forward torch.fx traces (its glue planned as a region, calling the
    blocks as modules): fully_shard per block, then the root."""
    import fxamp
    from torch.distributed.fsdp import fully_shard
    from _block_nets import Net

    torch.manual_seed(0)
    ref = Net(4)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    for m in (model, ref):
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)
    results = []
    for m, autocast in ((model, False), (ref, True)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x = torch.randn(2 + step, 8, generator=torch.Generator().manual_seed(rank + step))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                out = m(x)
            loss = out.float().pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        results.append((losses, [p.full_tensor().detach().clone() for p in m.parameters()]))
    (losses, params), (ref_losses, ref_params) = results
    return [losses == ref_losses, all(torch.equal(p, q) for p, q in zip(params, ref_params)),
            fxamp.plan_of(model).header["glue"].split(":")[0]]


def test_fully_shard_per_block_around_a_traced_glue_trains_like_fsdp2_with_autocast():
    results = run_spawned(_traced_glue)
    for rank in (0, 1):
        assert results[rank] == [True, True, "the model's own forward, traced by torch.fx "
                                              "with the regions as calls"], results[rank]
