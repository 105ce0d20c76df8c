"""Blocks (rewriter/blocks.py): ``amp_rewrite(model, inplace=True)`` without example inputs
keeps the model's module tree. Each block (a repeated child, an HF ``_no_split_modules``
layer) stays a module called as one, computing with its own graph planned on its first call;
identical blocks share one plan; the glue runs under torch.autocast. Compared with the same
model under torch.autocast: losses, gradients, eval outputs bit for bit; hooks on blocks
added after the rewrite fire; per-layer torch.compile runs the compiled layers."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.rewriter.blocks import block_paths
from _block_nets import tiny_llama

BF16 = torch.bfloat16
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _step(model, autocast: bool, **kwargs):
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = model(input_ids=IDS, labels=IDS, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _equal_grads(a: dict, b: dict) -> list:
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_block_paths_are_the_repeated_children_and_hf_layers():
    assert block_paths(tiny_llama(3)) == [f"model.layers.{i}" for i in range(3)]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).relu()

    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Block(), Block(), nn.ReLU()),
                        nn.Linear(4, 4), nn.Linear(4, 4))
    assert block_paths(net) == ["1.0", "1.1"]  # (torch.nn's own classes are no blocks)


def test_llama_trains_like_autocast_and_identical_blocks_share_one_plan(caplog):
    ref = tiny_llama(3)
    model = copy.deepcopy(ref)
    with caplog.at_level(logging.INFO, logger="fxamp"):
        assert fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                                 inplace=True) is model
        assert not fxamp.plan_of(model).planned  # (before the first call: its skeleton)
        loss, grads = _step(model, False)
    ref_loss, ref_grads = _step(ref, True)
    assert torch.equal(loss, ref_loss)
    assert not _equal_grads(grads, ref_grads)
    # (one trace, three layers; the glue's modules are regions too, each traced once)
    assert caplog.text.count("LlamaDecoderLayer: planning it on this call") == 1
    plan = fxamp.plan_of(model)
    assert plan.header["frontend"] == "blocks"
    assert "the same plan as model.layers.0" in plan.nodes["model.layers.2"].reason
    assert not any(n.startswith("model.layers.1/") for n in plan.nodes)
    assert any(n.startswith("model.layers.0/") for n in plan.nodes)
    assert fxamp.Plan.from_text(plan.to_text()) == plan
    assert type(model) is transformers.LlamaForCausalLM
    assert list(model.state_dict()) == list(ref.state_dict())
    model.eval(), ref.eval()
    with torch.no_grad():
        got = model(input_ids=IDS).logits
        with torch.autocast("cpu", dtype=BF16):
            want = ref(input_ids=IDS).logits
    assert torch.equal(got, want.float())


def test_a_hook_added_to_a_layer_after_the_rewrite_fires_and_counts():
    """NEFTune-style: a forward hook on a decoder layer changes its output; it fires under
    fxamp as under autocast, and the loss and gradients stay autocast's."""
    ref = tiny_llama(3)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    fired = []

    def hook(module, args, out):
        fired.append(type(module).__name__)
        return (out[0] * 1.5,) + tuple(out[1:]) if isinstance(out, tuple) else out * 1.5

    model.model.layers[1].register_forward_hook(hook)
    ref.model.layers[1].register_forward_hook(hook)
    loss, grads = _step(model, False)
    ref_loss, ref_grads = _step(ref, True)
    assert fired == ["LlamaDecoderLayer", "LlamaDecoderLayer"]
    assert torch.equal(loss, ref_loss) and not _equal_grads(grads, ref_grads)


def test_with_an_example_a_hook_added_to_a_layer_later_plans_again_and_fires():
    """Planned ahead of time from an example, the graph runs the layers' ops inline: the
    call that finds a hook registered on a decoder layer since plans the model again with
    that layer kept as a call, so the hook fires once per call and the numbers stay
    autocast's."""
    ref = tiny_llama(3)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, (IDS,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    fired = []

    def hook(module, args, out):
        fired.append(1)

    model.model.layers[1].register_forward_hook(hook)
    loss, grads = _step(model, False)
    ref_loss, ref_grads = _step(ref, True)
    assert fired == [1]
    assert torch.equal(loss, ref_loss) and not _equal_grads(grads, ref_grads)
    _step(model, False)
    assert fired == [1, 1]


def test_per_layer_compile_runs_the_compiled_layers_and_equals_eager():
    ref = tiny_llama(2)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    eager_loss, eager_grads = _step(copy.deepcopy(model), False)
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    for layer in model.model.layers:
        layer.compile(backend=backend)
    torch._dynamo.reset()
    loss, grads = _step(model, False)  # (the first call plans, outside the compiled trace)
    assert not _equal_grads(grads, eager_grads)
    model.zero_grad()
    loss, grads = _step(model, False)
    assert compiled, "the compiled layers never ran"
    assert torch.equal(loss, eager_loss) and not _equal_grads(grads, eager_grads)
    ref_loss, _ = _step(ref, True)
    assert torch.equal(loss, ref_loss)


def test_hf_gradient_checkpointing_trains_like_autocast():
    ref = tiny_llama(3)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads = _step(model, False)
    ref_loss, ref_grads = _step(ref, True)
    assert torch.equal(loss, ref_loss) and not _equal_grads(grads, ref_grads)


@pytest.mark.parametrize("partition", ["auto", "flat"])
def test_a_second_rewrite_with_an_example_and_another_policy_undoes_the_blocks_first(partition):
    """The blocks planned with the first policy are undone; the default partition puts the
    model in block mode again, planned on the example with the new policy (the head, which
    it names, a region of its own), ``"flat"`` makes one graph of it."""
    ref = tiny_llama(2)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    model(input_ids=IDS)
    fxamp.amp_rewrite(model, (IDS,),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu", partition=partition,
                                               policy="compute=bf16,target=cpu,fp32:lm_head"),
                      inplace=True)
    plan = fxamp.plan_of(model)
    assert (plan.header["frontend"] == "blocks") == (partition == "auto")
    assert ("forward" in model.model.layers[0].__dict__) == (partition == "auto")
    head = [line for line in plan.nodes.values() if line.module == "lm_head"
            and "linear" in line.op]
    assert head and all(line.dtype == torch.float32 for line in head)
    with torch.no_grad():
        got = model(IDS).logits
    assert got.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ghostnet_050", "fastvit_t8", "test_vit",
                                  "test_efficientnet"])
@pytest.mark.parametrize("example", [True, False], ids=["example", "blocks"])
def test_timm_models_rewritten_in_train_mode_equal_autocast_in_eval(name, example):
    """Models whose train and eval traces differ (finding 4): rewritten in train mode,
    then put in eval mode, each mode runs the graph traced for it."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=10).train()
    model = copy.deepcopy(ref)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    fxamp.amp_rewrite(model, (x,) if example else None,
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    torch.manual_seed(3)
    got = model(x)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x)
    assert torch.equal(got, want.float())
    model.eval(), ref.eval()
    with torch.no_grad():
        got = model(x)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x)
    assert torch.equal(got, want.float())


def test_gpt2_generate_with_its_kv_cache_in_block_mode_gives_autocast_tokens():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
        with torch.autocast("cpu", dtype=BF16):
            want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    plan = fxamp.plan_of(model)
    assert plan.header["frontend"] == "blocks"
    assert {"transformer.h.0", "transformer.h.1"} <= set(plan.nodes)


def test_gpt2_dropout_in_block_mode_draws_what_autocast_draws_from_step_0():
    """GPT-2 has dropout in the glue and in its blocks, and passes its blocks a KV cache they
    append to: the first call (which plans every block, running their code on copies of
    the cache) and the next one compute and draw the RNG exactly as autocast's calls do."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    ref = transformers.GPT2LMHeadModel(cfg).train()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    calls = []
    model.transformer.h[1].register_forward_hook(lambda *a: calls.append(1))
    for step in range(2):
        torch.manual_seed(step)
        got = model(ids, labels=ids).loss
        after = torch.rand(1)
        torch.manual_seed(step)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(ids, labels=ids).loss
        assert torch.equal(got, want) and torch.equal(after, torch.rand(1)), step
    assert len(calls) == 2  # (planning runs no hook of the user's)


class _Scaled(nn.Module):
    """A block whose code reads a plain setting that differs from block to block."""

    def __init__(self, rate: float, shift: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.rate, self.shift = rate, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(self.lin(x), self.shift, dims=-1) * (1 - self.rate)


def test_blocks_whose_settings_differ_do_not_share_a_plan():
    """Rates and shifts are baked into a trace: a block planned with another block's graph
    would compute with that block's values."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Scaled(0.1 * i, i) for i in range(4)])
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    out = model(x)
    with torch.autocast("cpu", dtype=BF16):
        expected = ref(x)
    assert torch.equal(out.float(), expected.float())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["efficientnet_b0", "swin_t"])
def test_torchvision_stochastic_depth_and_shifted_windows_train_like_autocast(name):
    """torchvision's stochastic depth rises with depth and Swin shifts every other block's
    windows: block mode plans each setting apart and trains bit for bit like autocast."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    grads = []
    for m, autocast in ((ref, True), (model, False)):
        torch.manual_seed(1)  # (the same stochastic-depth draws on both sides)
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        grads.append({k: p.grad for k, p in m.named_parameters()})
    assert fxamp.plan_of(model).header["frontend"] == "blocks"
    assert not _equal_grads(*grads)


@pytest.mark.slow
def test_hf_beit_with_drop_path_trains_then_evaluates_like_autocast():
    """A block assembled from rewritten children, one traced for train mode only (BEiT's
    drop path): the block is that mode's only, so its first eval call is planned anew
    instead of running the train-mode child (which refused with ModeError)."""
    torch.manual_seed(0)
    cfg = transformers.BeitConfig(image_size=32, patch_size=8, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, use_relative_position_bias=True,
                                  drop_path_rate=0.1)
    model = transformers.BeitModel(cfg).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    outs = []
    for m, autocast in ((ref, True), (model, False)):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            train = m(x).last_hidden_state
        m.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
            outs.append((train.float(), m(x).last_hidden_state.float()))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
