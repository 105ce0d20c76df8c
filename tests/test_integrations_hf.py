"""Hugging Face inside its own stack: ``amp_rewrite(model, inplace=True)`` keeps the model
(``save_pretrained`` / ``from_pretrained``, ``config``, ``state_dict`` keys) and trains in
``transformers.Trainer`` (its default fused AdamW included) exactly like the same Trainer
with ``bf16=True`` (torch.autocast) on the original model."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import fxamp

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _data(n: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (n, 8), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": torch.tensor(i % 3)} for i in range(n)]


def _rewrite(model):
    batch = transformers.default_data_collator(_data(4))
    return fxamp.amp_rewrite(model,
                             config=fxamp.RewriteConfig.make(example_kwargs=batch, dtype=BF16,
                                                             target="cpu"), inplace=True)


def test_inplace_rewrite_is_the_model_with_its_keys_and_methods(tmp_path):
    ref = _bert()
    model = copy.deepcopy(ref)
    out = _rewrite(model)
    assert out is model and type(model) is type(ref)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert fxamp.plan_of(model).header["frontend"] == "blocks"  # (the layers stay modules)
    assert model.config.num_labels == 3
    model.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path)
    for (k, v), w in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(v, w), k


def test_eval_and_train_modes_reach_the_rewritten_graph():
    ref = _bert()
    model = copy.deepcopy(ref)
    _rewrite(model)
    batch = transformers.default_data_collator(_data(4))
    for mode in (False, True, False):
        model.train(mode)
        ref.train(mode)
        torch.manual_seed(5)
        got = model(**batch).logits
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(**batch).logits
        assert torch.equal(got, want), mode  # dropout off in eval, on in train


def test_a_call_with_arguments_the_rewrite_did_not_see_is_planned_on_that_call():
    """In place, a call with arguments the example did not have gets a graph of its own
    (autocast's numbers); the module amp_rewrite returns refuses it by name."""
    ref = _bert().eval()
    batch = transformers.default_data_collator(_data(4))
    gm = fxamp.amp_rewrite(copy.deepcopy(ref), (batch["input_ids"],),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    with pytest.raises(fxamp.FxampError, match="called with .attention_mask. a tensor.*example had .attention_mask. left out"):
        gm(**batch)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, (batch["input_ids"],),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu"), inplace=True)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(**batch)
    got = model(**batch)
    assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)


def _trainer(model, tmp_path, bf16: bool):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=4, learning_rate=5e-3, logging_steps=1, report_to=[], use_cpu=True,
        bf16=bf16, save_strategy="no", seed=3, dataloader_num_workers=0,
        disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                eval_dataset=_data(8))


def test_hf_trainer_default_fused_adamw_trains_like_trainer_bf16(tmp_path):
    ref = _bert()
    model = copy.deepcopy(ref)
    _rewrite(model)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    runs = []
    for m, bf16 in ((model, False), (ref, True)):
        trainer = _trainer(m, tmp_path / str(bf16), bf16)
        trainer.train()
        assert trainer.optimizer.defaults.get("fused"), "the Trainer's default is fused"
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        runs.append((losses, trainer.evaluate()["eval_loss"], trainer))
    (losses, eval_loss, trainer), (ref_losses, ref_eval, _) = runs
    assert len(losses) == 4 and losses == ref_losses and ref_losses[-1] != ref_losses[0]
    assert eval_loss == ref_eval
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), k
    trainer.save_model(str(tmp_path / "saved"))
    loaded = type(ref).from_pretrained(str(tmp_path / "saved"))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_generate_with_its_kv_cache_gives_autocast_s_tokens_every_block_planned(caplog):
    ref = _gpt2()
    model = copy.deepcopy(ref)
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                          inplace=True)
    assert "changed its own state" not in caplog.text  # quiet on a stock HF model
    plan = fxamp.plan_of(model)  # (block 1 shares block 0's plan: its line names it)
    assert {"transformer.h.0", "transformer.h.1"} <= set(plan.nodes)
    assert any(n.startswith("transformer.h.0/") for n in plan.nodes)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
        with torch.autocast("cpu", dtype=BF16):
            want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    assert got.shape == (1, 12) and torch.equal(got, want)


def test_no_side_effect_warning_on_a_stock_bert(caplog):
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        _rewrite(_bert())
    assert "changed its own state" not in caplog.text


def test_a_plain_peft_lora_model_trains_like_autocast(caplog):
    peft = pytest.importorskip("peft")
    base = _gpt2().train()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["c_attn"]))
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(4))
    with caplog.at_level(logging.WARNING, logger="fxamp"):
        assert fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                                 inplace=True) is model
    assert "changed its own state" not in caplog.text
    assert type(model) is type(ref) and list(model.state_dict()) == list(ref.state_dict())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    runs = []
    for m, autocast in ((model, False), (ref, True)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2,
                                fused=True)
        losses = []
        for step in range(3):
            torch.manual_seed(step)  # the same dropout masks
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                logits = m(ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     ids.flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in m.parameters()]))
    assert runs[0][0] == runs[1][0] and runs[1][0][-1] < runs[1][0][0]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))


def _clm_data(n: int = 16):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 100, (n, 12), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(n)]


@pytest.mark.slow
def test_gpt2_trainer_with_no_example_gives_trainer_bf16_losses_num_items_in_batch(tmp_path):
    """The Trainer sets use_cache=False and passes num_items_in_batch on every training call
    (the loss is its sum over the label tokens divided by it): an in-place rewrite with no
    example inputs plans the model on the Trainer's first call with every keyword it passes,
    and the losses, eval loss and weights equal Trainer(bf16=True) from step 0."""
    ref = _gpt2().train()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu"),
                      inplace=True)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    runs = []
    for m, bf16 in ((model, False), (ref, True)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(bf16)), per_device_train_batch_size=4,
            per_device_eval_batch_size=4, max_steps=3, learning_rate=5e-3, logging_steps=1,
            report_to=[], use_cpu=True, bf16=bf16, save_strategy="no", seed=3,
            dataloader_num_workers=0, disable_tqdm=True, gradient_accumulation_steps=2)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=_clm_data(),
                                       eval_dataset=_clm_data(8))
        trainer.train()
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        runs.append((losses, trainer.evaluate()["eval_loss"]))
    (losses, eval_loss), (ref_losses, ref_eval) = runs
    assert len(losses) == 3 and losses == ref_losses and ref_losses[-1] != ref_losses[0]
    assert eval_loss == ref_eval
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), k
