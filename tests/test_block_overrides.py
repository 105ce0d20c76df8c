"""Overrides in block mode (``amp_rewrite(model, config=..., inplace=True)`` without
example inputs, each block planned on its own): an absolute module path inside one block
changes that block alone (which then has a plan of its own), a relative one every block,
one naming a module of the glue (the model's own forward, under torch.autocast) makes it a
region of its own, and one naming a module that holds blocks is refused at ``amp_rewrite``
time, with advice that works when followed."""
from __future__ import annotations

import pytest
import torch

import fxamp
from _block_nets import InFp32

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


def test_an_override_of_a_glue_module_makes_it_a_region_that_trains_like_autocast_with_it_in_fp32():
    """``fp32:lm_head`` on a model whose glue fx does not trace (a Hugging Face Llama), with
    the default partition: the head is a region of its own (as the glue's other modules
    with weights are, where the glue runs under autocast; the override was refused before),
    its lines are FP32, the final norm's are autocast's, and a training step equals autocast
    with the head run in FP32, loss and every gradient bit for bit."""
    model, ref = _llama(), _llama()
    fxamp.amp_rewrite(model, config="compute=bf16,target=cpu,fp32:lm_head", inplace=True)
    ref.lm_head = InFp32(ref.lm_head)
    loss = model(input_ids=IDS, labels=IDS).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(input_ids=IDS, labels=IDS).loss
    loss.backward(), expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    lines = fxamp.plan_of(model).nodes
    head = [n for n, line in lines.items() if line.module == "lm_head" and line.op == "F.linear"]
    assert head and all(lines[n].dtype == torch.float32 for n in head)
    plain = fxamp.plan_of(_planned("compute=bf16,target=cpu")).nodes
    assert {n: (line.module, line.dtype) for n, line in lines.items() if line.module != "lm_head"
            } == {n: (line.module, line.dtype) for n, line in plain.items()
                  if line.module != "lm_head"}


def test_an_override_of_a_module_holding_blocks_is_refused_up_front_and_the_advice_works():
    """A module of the glue that holds the blocks (``model``, a ``LlamaModel`` with its own
    forward) cannot be a region: refused at ``amp_rewrite`` time, and the advice, naming
    the modules inside it, works: every linear inside it computes in FP32, the head's not."""
    with pytest.raises(fxamp.PolicyError, match="names model, outside every region.*"
                                                "'fp32:model.\\*'"):
        fxamp.amp_rewrite(_llama(), config="compute=bf16,fp32:model", inplace=True)
    inside = _planned("compute=bf16,target=cpu,fp32:model.*")
    lines = fxamp.plan_of(inside).nodes.values()
    linears = [line for line in lines if line.op == "aten.linear"]
    assert linears and all(line.dtype == torch.float32 for line in linears)
    head = [line for line in lines if line.module == "lm_head" and line.op == "F.linear"]
    assert head and all(line.dtype == torch.bfloat16 for line in head)


def test_a_wildcard_of_absolute_paths_reaches_each_region_it_names():
    """``fp32:transformer.*`` on GPT-2 (its glue under autocast) names modules in every
    block and in the glue: each module of the glue it names is a region with FP32 lines,
    each block takes it (a module it names that runs no node, the eager attention's
    dropout, is not refused), and the whole override matches."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=32, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    fxamp.amp_rewrite(model, config="compute=bf16,target=cpu,fp32:transformer.*", inplace=True)
    model(IDS[:, :8] % 128)
    lines = fxamp.plan_of(model).nodes.values()
    computed = [line for line in lines if line.module.startswith("transformer.")
                and line.op not in ("get_attr", "placeholder")]
    assert computed and all(line.dtype == torch.float32 for line in computed)
    assert {"transformer.wte", "transformer.drop", "transformer.ln_f"} <= set(
        fxamp.graphs_of(model))
    head = [line for line in lines if line.module == "lm_head" and line.op == "F.linear"]
    assert head and all(line.dtype == torch.bfloat16 for line in head)  # (not named)


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


def test_with_partition_blocks_a_wildcard_naming_a_glue_region_changes_exactly_its_lines():
    """``fp32:lm_head*`` names the head's region by a pattern, not its exact path: it
    reaches that region (before, it went to the repeated blocks, where it matched nothing)
    and changes exactly its lines."""
    plain, model = _llama(), _llama()
    for m, policy in ((plain, "compute=bf16,target=cpu"),
                      (model, "compute=bf16,target=cpu,fp32:lm_head*")):
        fxamp.amp_rewrite(m, config=fxamp.RewriteConfig.make(policy=policy, partition="blocks"),
                          inplace=True)
        m(IDS)
    before, after = _lines(plain), _lines(model)
    changed = {n for n in after if after[n] != before[n]}
    assert changed and all(after[n][0] == "lm_head" for n in changed)
    assert any(before[n][1] == torch.bfloat16 for n in changed)


@pytest.mark.parametrize("typo,want,advice", [
    ("model.layers.7.mlp.*", "names no module of LlamaForCausalLM.*closest module paths: "
     "model.layers.1.mlp.*", "model.layers.1.mlp.*"),
    ("nn.LlamaRMSNorm", "torch.nn has no LlamaRMSNorm.*the model's own LlamaRMSNorm modules "
     "are at model.layers.0.input_layernorm, .* name them by their paths", "model.norm"),
    ("aten.lineer", "names no op: no aten.lineer; closest: aten.linear", "aten.linear"),
    ("F.sofmax", "names no op: no F.sofmax; closest: F.softmax", None),
    ("model.layers.0/add", None, None),  # (may be a plan line's name: checked on the call)
])
def test_a_misspelt_module_path_or_op_label_is_refused_at_rewrite_time_with_the_fix(
        typo, want, advice):
    """Nothing is traced at ``amp_rewrite`` time without example inputs: a pattern that can
    only be a module path of the model (its first part a child of it) and names none, or
    an op label of torch's that names no op, is refused there, not on the first training
    step; the closest path or label it names, followed, is taken and changes lines."""
    model = _llama()
    if want is None:  # (may name a node: not refused before a trace)
        fxamp.amp_rewrite(model, config=f"compute=bf16,fp32:{typo}", inplace=True)
        with pytest.raises(fxamp.PolicyError, match="matches no node"):  # (on the call)
            model(input_ids=IDS)
        return
    with pytest.raises(fxamp.PolicyError, match=want):
        fxamp.amp_rewrite(model, config=f"compute=bf16,fp32:{typo}", inplace=True)
    assert model.forward.__func__ is type(model).forward  # (left as it was)
    if advice is not None:
        fixed = _planned(f"compute=bf16,target=cpu,fp32:{advice}")
        assert any(line.dtype == torch.float32 and line.rule == "user"
                   for line in fxamp.plan_of(fixed).nodes.values())


def test_what_is_checked_before_any_trace():
    from fxamp.overrides import _path_only, _unknown_label

    children = ["model", "lm_head"]
    assert _path_only("model.layers.9", children)
    assert not _path_only("lm_haed", children)  # (one word: a node name too)
    assert not _path_only("model.layers.0/add", children)  # (a nested plan line's name)
    assert not _path_only("torch.cat", ["torch"])  # (a Python module's name: a label)
    assert not _path_only("*.mlp", children)
    assert _unknown_label("nn.ParametrizationList") == ""  # (nn.<Name> of torch.nn.utils)
    assert _unknown_label("mypkg.MyBlock") == "" and _unknown_label("aten.lin*") == ""


def test_a_misspelt_torch_nn_label_is_refused_at_rewrite_time_and_the_closest_works():
    from _block_nets import Net

    with pytest.raises(fxamp.PolicyError, match="torch.nn has no Lineer; closest: nn.Linear"):
        fxamp.amp_rewrite(Net(), config="compute=bf16,fp32:nn.Lineer", inplace=True)
    model = Net()
    fxamp.amp_rewrite(model, config="compute=bf16,target=cpu,fp32:nn.Linear", inplace=True)
    model(torch.randn(3, 8))
    linears = [line for line in fxamp.plan_of(model).nodes.values() if line.op == "nn.Linear"]
    assert linears and all(line.dtype == torch.float32 for line in linears)
