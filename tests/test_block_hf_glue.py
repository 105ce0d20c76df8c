"""Hugging Face models whose own forward torch.fx does not trace, rewritten in place with
the default partition: the glue's modules with weights (embeddings, rotary tables, final
norms, heads, a pooler) are regions of their own with plan lines, and two training steps
(dropout on) equal the same steps under ``torch.autocast``, loss and every gradient bit for
bit, planned lazily or on an example."""
from __future__ import annotations

import copy

import pytest
import torch

import fxamp

transformers = pytest.importorskip("transformers")
BF16 = torch.bfloat16
IDS = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


def _gpt2(cache: bool):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=cache))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=2, decoder_start_token_id=0))


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3))


CASES = {
    "gpt2": (lambda: _gpt2(False), {"input_ids": IDS, "labels": IDS},
             {"transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"}),
    "gpt2 use_cache": (lambda: _gpt2(True), {"input_ids": IDS, "labels": IDS},
                       {"transformer.wte", "transformer.ln_f", "lm_head"}),
    "t5": (_t5, {"input_ids": IDS, "labels": IDS},
           {"encoder.final_layer_norm", "decoder.final_layer_norm", "lm_head"}),
    "bert": (_bert, {"input_ids": IDS, "labels": torch.tensor([0, 2])},
             {"bert.embeddings", "bert.pooler", "classifier"}),
}


@pytest.mark.parametrize("example", [False, True], ids=["lazy", "example"])
@pytest.mark.parametrize("name", list(CASES))
def test_glue_modules_are_regions_and_two_steps_equal_autocast(name, example):
    make, batch, glue = CASES[name]
    torch.manual_seed(0)
    ref = make().train()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, None, fxamp.RewriteConfig.make(
        dtype=BF16, target="cpu", example_kwargs=batch if example else None), inplace=True)
    for step in range(2):
        runs = []
        for m, autocast in ((model, False), (ref, True)):
            torch.manual_seed(step)  # (the same dropout masks)
            m.zero_grad()
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                loss = m(**batch).loss
            loss.backward()
            runs.append((loss.detach(), [p.grad for p in m.parameters()]))
        (loss, grads), (want, want_grads) = runs
        assert torch.equal(loss, want), step
        for i, (g, w) in enumerate(zip(grads, want_grads)):
            assert (g is None) == (w is None) and (g is None or torch.equal(g, w)), (step, i)
        with torch.no_grad():
            for m in (model, ref):
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.01 * p.grad
    assert glue <= set(fxamp.graphs_of(model))
    lines = fxamp.plan_of(model).nodes.values()
    assert {line.module for line in lines} >= glue
    assert "torch.autocast" in fxamp.plan_of(model).header["glue"]
    if name == "t5":  # (its `shared` embedding: the stacks call their own, tied to it)
        line = fxamp.plan_of(model).nodes["shared"]
        assert line.reason.endswith("the model's calls so far did not call it")


def test_a_glue_module_reached_twice_or_held_by_a_block_too_is_not_made_a_region_twice():
    """The glue's modules the default makes regions: each once (one module under two paths,
    as an alias attribute makes it), and none a block also holds (each region would cast its
    weight on its own, where autocast's cast cache casts it once a forward)."""
    import torch.nn as nn

    from fxamp.rewriter.blocks import own_glue_parts

    class Block(nn.Module):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.fc, self.shared = nn.Linear(4, 4), shared

        def forward(self, x):
            return self.shared(self.fc(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.alias = self.embed  # (the same module under a second path)
            self.shared = nn.Linear(4, 4)  # (held by every block too)
            self.blocks = nn.ModuleList([Block(self.shared) for _ in range(2)])
            self.head = nn.Linear(4, 2)

    model = Net()
    assert own_glue_parts(model, ["blocks.0", "blocks.1"]) == ["embed", "head"]
