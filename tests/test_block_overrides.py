"""Overrides in block mode (``amp_rewrite(model, config=..., inplace=True)`` without
example inputs, each block planned on its own): an absolute module path inside one block
changes that block alone (which then has a plan of its own), a relative one every block,
and one naming only the glue (the model's own forward, under torch.autocast) is refused at
``amp_rewrite`` time, with advice that works when followed."""
from __future__ import annotations

import pytest
import torch

import fxamp

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _planned(config: str):
    """A tiny Llama rewritten in block mode with ``config`` and called once."""
    model = _llama()
    fxamp.amp_rewrite(model, config=config, inplace=True)
    model(input_ids=IDS)
    return model


def _lines(model) -> dict:
    """Each plan line's (module path, dtype), by node name."""
    return {name: (node.module, node.dtype) for name, node in fxamp.plan_of(model).nodes.items()}


def test_an_absolute_path_in_one_block_changes_that_block_alone():
    plain, model = _planned("compute=bf16"), _planned("compute=bf16,fp32:model.layers.1.mlp.*")
    before, after = _lines(plain), _lines(model)
    # (layer 1 has a plan of its own: its lines are listed, not "the same plan as")
    assert any(n.startswith("model.layers.1/") for n in after)
    assert not any(n.startswith("model.layers.1/") for n in before)
    mlp = {n for n, (module, _) in after.items() if module.startswith("model.layers.1.mlp.")
           and n.startswith("model.layers.1/") and ("linear" in n or "silu" in n)}
    assert mlp and all(after[n][1] == torch.float32 for n in mlp), mlp
    same = {n.replace("model.layers.1/", "model.layers.0/") for n in mlp}
    assert all(before[n][1] == torch.bfloat16 for n in same if "linear" in n)
    assert {n: v for n, v in after.items() if n.startswith("model.layers.0/")} == {
        n: v for n, v in before.items() if n.startswith("model.layers.0/")}


def test_a_relative_path_changes_every_block():
    plain, model = _planned("compute=bf16"), _planned("compute=bf16,fp32:mlp.down_proj")
    after, before = _lines(model), _lines(plain)
    downs = [n for n, (module, _) in after.items()
             if module.endswith("mlp.down_proj") and "linear" in n]
    assert downs and all(after[n][1] == torch.float32 for n in downs)
    assert all(before[n][1] == torch.bfloat16 for n in downs)


def test_an_override_of_the_glue_is_refused_up_front_and_the_advice_works():
    with pytest.raises(fxamp.PolicyError, match="names lm_head, outside every region.*partition='blocks'"):
        fxamp.amp_rewrite(_llama(), config="compute=bf16,fp32:lm_head", inplace=True)
    model = _llama()  # (the advice: with example inputs, one plan, lm_head included)
    fxamp.amp_rewrite(model, (IDS,), "compute=bf16,fp32:lm_head", inplace=True)
    model(IDS)
    heads = [v for v in _lines(model).values() if v[0] == "lm_head"]
    assert heads and all(dtype == torch.float32 for _, dtype in heads)


@pytest.mark.parametrize("example", [False, True])
def test_with_partition_blocks_an_override_of_the_glue_changes_exactly_its_lines(example):
    """The advice's other half: with ``partition="blocks"`` the glue's modules (embeddings,
    final norm, head) are regions with plan lines, so ``fp32:lm_head`` changes exactly the
    head's lines, with or without example inputs (planned then on the example)."""
    plain, model = _llama(), _llama()
    ex = (IDS,) if example else None
    fxamp.amp_rewrite(plain, ex, fxamp.RewriteConfig.make(
        policy="compute=bf16,target=cpu", partition="blocks"), inplace=True)
    fxamp.amp_rewrite(model, ex, fxamp.RewriteConfig.make(
        policy="compute=bf16,target=cpu,fp32:lm_head", partition="blocks"), inplace=True)
    if not example:
        plain(IDS), model(IDS)
    before, after = _lines(plain), _lines(model)
    assert set(before) == set(after)
    changed = {n for n in after if after[n] != before[n]}
    assert changed and all(after[n][0] == "lm_head" for n in changed)
    assert all(after[n][1] == torch.float32 for n in changed)
    assert any(before[n][1] == torch.bfloat16 for n in changed)  # (the head's linear)


def test_an_op_label_changes_every_block_and_one_the_blocks_lack_is_refused_naming_the_glue():
    plain, model = _planned("compute=bf16"), _planned("compute=bf16,fp32:aten.silu")
    before, after = fxamp.plan_of(plain).nodes, fxamp.plan_of(model).nodes
    silu = [n for n, p in after.items() if p.op == "aten.silu"]
    assert silu and all(after[n].dtype == torch.float32 != before[n].dtype for n in silu)
    # (the embedding is in the glue, which fx does not take for a Hugging Face model)
    lacking = _llama()
    fxamp.amp_rewrite(lacking, config="compute=bf16,fp32:aten.embedding", inplace=True)
    with pytest.raises(fxamp.PolicyError, match="matches no node of LlamaForCausalLM's "
                                                "blocks or glue .*runs under torch.autocast"):
        lacking(input_ids=IDS)


def test_with_partition_blocks_an_op_label_reaches_the_glue_modules_regions_too():
    # (the head, a region of its own, is planned by fx: its label is nn.Linear; the
    # decoder layers' linears are aten.linear)
    model = _llama()
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(
        policy="compute=bf16,fp32:*inear", partition="blocks"), inplace=True)
    model(input_ids=IDS)
    lines = fxamp.plan_of(model).nodes
    linears = [n for n, p in lines.items() if p.op in ("aten.linear", "nn.Linear")]
    assert "lm_head" in linears and any(n.startswith("model.layers.0/") for n in linears)
    assert all(lines[n].dtype == torch.float32 for n in linears)
