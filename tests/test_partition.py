"""``RewriteConfig.partition``: which modules an in-place rewrite plans as regions of their
own, each kept in the model's module tree. In place, example inputs (with the default
partition or ``"blocks"``) are only an early first call: the plan is made now, on the example, and equals the plan the lazy
first call makes on the same batch; the layers stay modules, so a hook added later fires and
per-layer ``compile()`` runs the compiled layers (FSDP2 per layer: test_blocks_fsdp2.py)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import FxampError
from _block_nets import tiny_llama

BF16 = torch.bfloat16
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _config(partition="auto"):
    return fxamp.RewriteConfig.make(dtype=BF16, target="cpu", partition=partition)


def _step(model, autocast: bool):
    torch.manual_seed(2)  # (GPT-2's dropout)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    return out.loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("partition", ["auto", "blocks"])
def test_an_example_plans_now_the_plan_the_first_call_makes(partition):
    ref = tiny_llama()
    ahead, lazy = copy.deepcopy(ref), copy.deepcopy(ref)
    fxamp.amp_rewrite(ahead, (IDS,), _config(partition), inplace=True)
    plan = fxamp.plan_of(ahead)  # (planned: no call of the user's yet)
    assert plan.header["frontend"] == "blocks"
    fxamp.amp_rewrite(lazy, config=_config(partition), inplace=True)
    lazy(IDS)
    assert plan.to_text() == fxamp.plan_of(lazy).to_text()
    assert [type(layer) for layer in ahead.model.layers] == [
        transformers.models.llama.modeling_llama.LlamaDecoderLayer] * 2
    loss, grads = _step(ahead, False)
    ref_loss, ref_grads = _step(ref, True)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


@pytest.mark.parametrize("partition", ["auto", "blocks"])
def test_the_example_call_changes_no_statistics_and_no_random_state(partition):
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.bn(self.fc(x))) + x

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 2)).train()
    before = [b.clone() for b in model.buffers()]
    x = torch.randn(4, 8)
    rng = torch.random.get_rng_state()
    fxamp.amp_rewrite(model, (x,), _config(partition), inplace=True)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert fxamp.plan_of(model).header["frontend"] == "blocks"


@pytest.mark.parametrize("partition", ["auto", "blocks"])
def test_with_an_example_a_hook_added_later_fires_and_per_layer_compile_runs(partition):
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, (IDS,), _config(partition), inplace=True)
    fired, compiled = [], []
    model.model.layers[1].register_forward_hook(lambda *a: fired.append(1))

    def backend(gm, example_inputs):
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    for layer in model.model.layers:
        layer.compile(backend=backend)
    torch._dynamo.reset()
    loss, _ = _step(model, False)
    assert fired == [1]
    assert compiled, "the compiled layers never ran"
    ref_loss, _ = _step(ref, True)
    assert torch.equal(loss, ref_loss)


def test_partition_flat_without_example_plans_the_whole_model_on_its_first_call():
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=_config("flat"), inplace=True)
    loss, _ = _step(model, False)
    assert fxamp.plan_of(model).header["frontend"] != "blocks"
    assert torch.equal(loss, _step(ref, True)[0])


def test_a_partition_function_picks_the_regions():
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    picked = []

    def mlps(path, module):
        picked.append(path)
        return path.endswith(".mlp")

    fxamp.amp_rewrite(model, (IDS,), _config(mlps), inplace=True)
    plan = fxamp.plan_of(model)
    assert plan.header["frontend"] == "blocks"
    assert {name.split("/")[0] for name in plan.nodes} >= {"model.layers.0.mlp",
                                                           "model.layers.1.mlp"}
    assert not any(p.startswith("model.layers.0.mlp.") for p in picked)  # (outermost only)
    loss, grads = _step(model, False)
    ref_loss, ref_grads = _step(ref, True)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_partition_blocks_returns_a_twin_that_keeps_the_tree_and_trains_like_autocast():
    """``inplace=False`` with ``partition="blocks"``: the result is a twin of the model
    rewritten in place (its own modules, of the model's classes, sharing its Parameters),
    planned now on the example with the in-place rewrite's plan, text for text; it trains
    like autocast, and the model itself still computes in FP32 with its own forward."""
    ref = tiny_llama()
    model, inplace = copy.deepcopy(ref), copy.deepcopy(ref)
    got = fxamp.amp_rewrite(model, (IDS,), _config("blocks"))
    fxamp.amp_rewrite(inplace, (IDS,), _config("blocks"), inplace=True)
    assert got is not model and type(got) is type(model)
    assert got.model.layers[1] is not model.model.layers[1]
    assert [p is q for p, q in zip(got.parameters(), model.parameters())] == [True] * len(
        list(model.parameters()))
    assert fxamp.plan_of(got).to_text() == fxamp.plan_of(inplace).to_text()
    with pytest.raises(FxampError):  # (the model itself is not rewritten)
        fxamp.plan_of(model)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
    loss, grads = _step(got, False)
    ref_loss, ref_grads = _step(ref, True)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_an_unknown_partition_is_refused_naming_the_valid_ones():
    with pytest.raises(FxampError, match="unknown partition 'layers'.*auto, blocks, flat"):
        _config("layers")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0,
                                  use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("make, glue", [
    (tiny_llama, ["model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"]),
    (_gpt2, ["transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"])])
def test_partition_blocks_plans_the_glues_modules_and_trains_like_autocast(make, glue):
    """The glue's modules (embeddings, final norm, head: a tied one too) are regions with
    plan lines; the code between them runs under autocast; 2 steps equal autocast's."""
    ref = make()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, (IDS,), _config("blocks"), inplace=True)
    plan = fxamp.plan_of(model)
    regions = [name for name in plan.nodes if "/" not in name]
    assert all(path in regions for path in glue), regions
    assert {plan.nodes[name].module for name in plan.nodes if name.startswith("lm_head/")} \
        == {"lm_head"}
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(2):
        loss, grads = _step(model, False)
        ref_loss, ref_grads = _step(ref, True)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()


def test_the_cli_plans_and_checks_a_partitioned_plan_and_names_one_blocks_change(
        tmp_path, capsys):
    """``fxamp plan/check --partition blocks``: the plan of the model in block mode (its
    blocks and the glue's modules), equal to what the Python API trains with; ``check``
    passes on it, and fails with the diff, naming that block alone, when one block's
    override changes."""
    from fxamp.cli import main

    factory = Path(__file__).with_name("_block_nets.py")
    path = tmp_path / "plan.txt"
    base = [f"{factory}:make", "--dtype", "bf16", "--target", "cpu", "--partition", "blocks"]
    assert main(["plan", *base, "-o", str(path)]) == 0
    text = path.read_text()
    assert "# frontend: blocks" in text and "\nstem/" in text and "\nhead/" in text
    assert main(["check", *base, "--plan", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", *base, "--policy", "fp32:blocks.1.fc1", "--plan", str(path)]) == 1
    out = capsys.readouterr().out
    changed = [line for line in out.splitlines() if line.startswith("~")]
    assert changed and all(line.split()[1].startswith("blocks.1/") for line in changed), out


def test_a_diff_of_plans_of_two_partitions_says_their_names_differ_and_the_advice_works(
        tmp_path, capsys):
    """The flat and the block plan of one model name their nodes differently: the diff
    lists their lines as removed and added and says why; plans of one partition, as it
    advises, compare line by line (equal plans: no diff, ``check`` passes)."""
    from fxamp.cli import main

    factory = Path(__file__).with_name("_block_nets.py")
    base = [f"{factory}:make", "--dtype", "bf16", "--target", "cpu"]
    flat, blocks, again = (tmp_path / f"{n}.txt" for n in ("flat", "blocks", "again"))
    assert main(["plan", *base, "--partition", "flat", "-o", str(flat)]) == 0
    assert main(["plan", *base, "--partition", "blocks", "-o", str(blocks)]) == 0
    note = "their node names differ, so their lines are listed as removed and added"
    summary = fxamp.diff(str(flat), str(blocks)).splitlines()[-1]
    assert note in summary and "the first plan is one graph and the second in block mode" \
        in summary
    assert note in fxamp.diff(str(flat), str(blocks), fmt="markdown")
    assert main(["plan", *base, "--partition", "blocks", "-o", str(again)]) == 0
    assert fxamp.diff(str(blocks), str(again)) == ""  # (one partition: compared)
    assert "the first plan is in block mode and the second one graph" in fxamp.diff(
        str(blocks), str(flat))
    capsys.readouterr()


def test_with_partition_blocks_a_relative_override_goes_to_the_blocks_only():
    """``fp32:mlp.down_proj`` names a module of every decoder layer: each layer's lines
    change, and the glue's regions (which hold no such module) are planned as without it
    (before, each glue region was refused: the override matched none of its nodes)."""
    plain, model = tiny_llama(), tiny_llama()
    fxamp.amp_rewrite(plain, (IDS,), _config("blocks"), inplace=True)
    fxamp.amp_rewrite(model, (IDS,), fxamp.RewriteConfig.make(
        policy="compute=bf16,target=cpu,fp32:mlp.down_proj", partition="blocks"), inplace=True)
    before, after = fxamp.plan_of(plain).nodes, fxamp.plan_of(model).nodes
    changed = {n for n in after if n in before and after[n].dtype != before[n].dtype}
    assert changed and all(after[n].module.endswith("mlp.down_proj") for n in changed)
    assert all(after[n].dtype == torch.float32 for n in changed)


def test_an_example_the_model_fails_on_leaves_the_model_as_it_was():
    model = tiny_llama()
    forward = model.forward
    with pytest.raises(IndexError, match="index out of range"):
        fxamp.amp_rewrite(model, (torch.full((2, 16), 500),), _config("blocks"),
                          inplace=True)  # (ids past its 128-token vocabulary)
    assert "forward" not in model.__dict__ and model.forward == forward
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    fxamp.amp_rewrite(model, (IDS,), _config("blocks"), inplace=True)  # (and can be again)
    assert fxamp.plan_of(model).planned


@pytest.mark.parametrize("partition", ["auto", "blocks"])
def test_a_deployment_plan_in_block_mode_measures_a_block_fed_fp16_as_the_fp32_model(
        partition):
    """``target=tensorrt`` in block mode: block 0 computes in FP16 and hands FP16 to block
    1, whose plan measures ranges on its call (a deployment plan's example is a
    calibration batch) by running its FP32 graph; that input is taken as the FP32 model
    has it. Block 1's first call failed with ``CalibrationDataError`` ("mat1 and mat2 must
    have the same dtype, but got Half and Float"). The output stays near FP32."""
    model = _gpt2().eval()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(policy="tensorrt",
                                                             partition=partition),
                      inplace=True)
    calls = []
    model.transformer.h[1].register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(args[0].dtype if args else
                                             kwargs["hidden_states"].dtype),
        with_kwargs=True)
    with torch.no_grad():
        got, want = model(IDS).logits, ref(IDS).logits
    assert calls == [torch.float16]  # (the case: block 1 is fed FP16)
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 1e-2
    assert fxamp.plan_of(model).nodes["transformer.h.1"].reason.startswith("a block")


@pytest.mark.slow  # (timm's import, densenet's depth)
@pytest.mark.parametrize("name", ["resnet18", "densenet121", "vit_tiny_patch16_224"])
def test_a_returned_twin_of_a_timm_model_trains_and_evaluates_like_autocast(name):
    """The returned twin (``inplace=False``, ``partition="blocks"``) of timm models (a
    densenet's ``BatchNormAct2d`` traces differently in train and eval): a training step's
    loss and every gradient, then an eval forward, equal autocast's bit for bit."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10,
                              **({"img_size": 64} if "vit" in name else {})).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    twin = fxamp.amp_rewrite(model, (x,), _config("blocks"))
    assert fxamp.plan_of(twin).header["frontend"] == "blocks"
    losses, grads = [], []
    for m, autocast in ((twin, False), (ref, True)):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
    assert torch.equal(*losses)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    twin.eval(), ref.eval()
    with torch.no_grad():
        got = twin(x)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x)
    assert torch.equal(got, want)
