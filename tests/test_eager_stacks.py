"""Hugging Face GPT-2, Llama and T5 on the eager front end (their roots' forwards stay Python
under torch.autocast, their children are rewritten graphs), each compared bit for bit with
the same stack under ``torch.autocast("cpu", bfloat16)`` on the original model: modes after
the rewrite, gradient checkpointing enabled before or after it, hooks added after it, and
the forward signature HF Trainer reads. (One graph of the whole model: ``partition="flat"``;
in place, the default keeps the blocks as regions, tested in ``test_blocks.py``.)"""
from __future__ import annotations

import copy
import functools
import inspect
import logging

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import fxamp

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _ids(shape=(2, 8), seed=2):
    return torch.randint(1, 128, shape, generator=torch.Generator().manual_seed(seed))


def _gpt2(train: bool):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train(train)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).train()


def _t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                                num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg).train()


def _rewrite(model, inplace: bool, *args, **kwargs):
    out = fxamp.amp_rewrite(model, args or None,
                            fxamp.RewriteConfig.make(example_kwargs=kwargs or None, dtype=BF16,
                                                     target="cpu", partition="flat"),
                            inplace=inplace)
    assert fxamp.plan_of(out).header["frontend"] == "eager"
    return out


def _loss(model, autocast: bool, seed: int = 5, **batch):
    torch.manual_seed(seed)  # the same dropout masks
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        return model(**batch).loss


def _three_steps(model, ref, ids) -> list:
    """3 AdamW steps of ``model`` and of ``ref`` under autocast: per run, each step's loss and
    the gradients of the trainable parameters."""
    runs = []
    for m, autocast in ((model, False), (ref, True)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        steps = []
        for _ in range(3):
            opt.zero_grad()
            loss = _loss(m, autocast, input_ids=ids, labels=ids)
            loss.backward()
            steps.append((loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()
                                        if p.requires_grad}))
            opt.step()
        runs.append(steps)
    return runs


@pytest.mark.parametrize("inplace", [True, False])
def test_gpt2_rewritten_in_train_mode_evaluates_and_generates_like_autocast(inplace):
    ref = _gpt2(train=True)
    ids = _ids()
    model = _rewrite(copy.deepcopy(ref), inplace, ids)
    model.eval()
    ref.eval()
    with torch.no_grad():
        got = model(ids).logits
        with torch.autocast("cpu", dtype=BF16):
            want = ref(ids).logits
        assert torch.equal(got, want)
        tokens = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
        with torch.autocast("cpu", dtype=BF16):
            ref_tokens = ref.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert tokens.shape == (1, 13) and torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("inplace", [True, False])
def test_gpt2_rewritten_in_eval_mode_trains_with_dropout_like_autocast(inplace):
    ref = _gpt2(train=False)  # as from_pretrained returns it
    ids = _ids()
    model = _rewrite(copy.deepcopy(ref), inplace, ids)
    model.train()
    ref.train()
    got = _loss(model, False, input_ids=ids, labels=ids)
    want = _loss(ref, True, input_ids=ids, labels=ids)
    assert got.item() == want.item()
    assert got.item() != _loss(ref.eval(), True, input_ids=ids, labels=ids).item()  # dropout
    got.backward()
    want.backward()
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, theirs[name].grad), name


def test_t5_rewritten_in_train_mode_evaluates_like_autocast():
    ref = _t5()
    ids, labels = _ids((2, 6)), _ids((2, 4), seed=3)
    model = _rewrite(copy.deepcopy(ref), True, input_ids=ids, labels=labels)
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert _loss(model, False, input_ids=ids, labels=labels).item() == _loss(
            ref, True, input_ids=ids, labels=labels).item()


def _counted(model):
    """Count the calls of torch.utils.checkpoint.checkpoint that ``model``'s HF layers make
    (HF binds the function at ``gradient_checkpointing_enable``)."""
    calls = []

    def checkpoint(*args, **kwargs):
        calls.append(1)
        return torch_checkpoint.checkpoint(*args, **kwargs)

    for module in model.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(fn, functools.partial) and fn.func is torch_checkpoint.checkpoint:
            module._gradient_checkpointing_func = functools.partial(checkpoint, *fn.args,
                                                                    **fn.keywords)
    return calls


def _checkpointed_step(model, autocast: bool, ids):
    """(loss, checkpoint calls, saved-tensor bytes, gradients) of one training step."""
    calls = _counted(model)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, autocast, input_ids=ids, labels=ids)
    loss.backward()
    return loss.item(), len(calls), sum(saved), {n: p.grad for n, p in
                                                 model.named_parameters()}


@pytest.mark.parametrize("when,reentrant,inplace", [("before", True, True),
                                                    ("after", False, True),
                                                    ("after", True, False)])
def test_llama_gradient_checkpointing_enabled_before_or_after_the_rewrite_checkpoints(
        when, reentrant, inplace):
    ref = _llama()
    ids = _ids()
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    model = copy.deepcopy(ref)
    if when == "before":
        model.gradient_checkpointing_enable(**kwargs)
    model = _rewrite(model, inplace, ids)
    if when == "after":  # (as HF Trainer does)
        model.gradient_checkpointing_enable(**kwargs)
    ref.gradient_checkpointing_enable(**kwargs)
    loss, calls, saved, grads = _checkpointed_step(model, False, ids)
    ref_loss, ref_calls, ref_saved, ref_grads = _checkpointed_step(ref, True, ids)
    assert (loss, calls, saved) == (ref_loss, ref_calls, ref_saved) and calls == 2
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    model.gradient_checkpointing_disable()
    assert _checkpointed_step(model, False, ids)[1:3] == (0, _checkpointed_step(
        _llama(), True, ids)[2])


def test_forward_hooks_added_after_the_rewrite_on_a_gpt2_block_and_its_final_norm_run():
    """A block (an eager root itself) and ``ln_f`` (a child fx rewrote) are called as
    modules by the eager forward: hooks registered on the model's modules run."""
    ref = _gpt2(train=False)
    ids = _ids()
    model = _rewrite(copy.deepcopy(ref), True, ids)
    seen = []
    outputs = []
    for m in (model, ref):
        def hook(module, args, out):
            seen.append(type(module).__name__)
            return out * 2
        handles = [m.transformer.h[0].register_forward_hook(hook),
                   m.transformer.ln_f.register_forward_hook(hook)]
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=m is ref):
            outputs.append(m(ids).logits)
        for handle in handles:
            handle.remove()
    assert seen == ["GPT2Block", "LayerNorm"] * 2 and torch.equal(*outputs)
    with torch.no_grad():  # removed: they stop running
        model(ids)
    assert len(seen) == 4


def test_a_hook_on_a_module_traced_into_a_child_s_graph_is_refused_by_name():
    model = _rewrite(_gpt2(train=False), True, _ids())
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, o: o)
    with pytest.raises(fxamp.FxampError, match="c_fc"):
        model(_ids())


def test_enable_input_require_grads_after_the_rewrite_feeds_reentrant_checkpointing():
    ref = _llama()
    ids = _ids()
    model = _rewrite(copy.deepcopy(ref), True, ids)
    for m in (model, ref):
        m.get_input_embeddings().weight.requires_grad_(False)
        m.enable_input_require_grads()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _, calls, _, grads = _checkpointed_step(model, False, ids)
    _, _, _, ref_grads = _checkpointed_step(ref, True, ids)
    assert calls == 2 and grads.pop("model.embed_tokens.weight") is None
    assert all(g is not None and torch.equal(g, ref_grads[n]) for n, g in grads.items())


@pytest.mark.parametrize("inplace", [True, False])
def test_the_forward_signature_is_the_model_s(inplace):
    ref = _gpt2(train=False)
    model = _rewrite(copy.deepcopy(ref), inplace, _ids())
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)


def _data(n: int = 8):
    ids = _ids((n, 8), seed=7)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": ids[i], "text": "a column the model does not take"}
            for i in range(n)]


def test_hf_trainer_default_columns_and_neftune_train_like_trainer_bf16(tmp_path):
    """remove_unused_columns=True (the default) reads the forward's signature; NEFTune
    hooks the input embeddings after the rewrite."""
    ref = _gpt2(train=False)
    batch = transformers.default_data_collator([{k: v for k, v in d.items() if k != "text"}
                                                for d in _data(4)])
    model = _rewrite(copy.deepcopy(ref), True, **batch)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    runs = []
    for m, bf16 in ((model, False), (ref, True)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(bf16)), per_device_train_batch_size=4,
            max_steps=3, learning_rate=5e-3, logging_steps=1, report_to=[], use_cpu=True,
            bf16=bf16, save_strategy="no", seed=3, dataloader_num_workers=0,
            disable_tqdm=True, neftune_noise_alpha=5.0)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=_data())
        trainer.train()
        runs.append([r["loss"] for r in trainer.state.log_history if "loss" in r])
    assert len(runs[0]) == 3 and runs[0] == runs[1]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_lora_on_llama_q_k_v_o_trains_like_peft_under_autocast():
    """PEFT's lora.Linear ends with ``result.to(torch_result_dtype)``, the dtype read from
    the base layer's output at run time (bf16 under autocast): the rewritten q/k/v/o give
    autocast's bf16 (the export front end traces that read as autocast's run sees it, so no
    cast of their outputs is needed), so RoPE and attention sum the LoRA gradients as
    autocast does."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # (PEFT starts B at zero: no gradient reaches A at step 0)
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    ids = _ids()
    _rewrite(model, True, ids)
    line = fxamp.plan_of(model).nodes["base_model.model/model/layers.0/self_attn/q_proj"]
    assert line.dtype == BF16
    for (loss, grads), (ref_loss, ref_grads) in zip(*_three_steps(model, ref, ids)):
        assert loss == ref_loss and grads.keys() == ref_grads.keys() and len(grads) == 16
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


@pytest.mark.parametrize("order", ["lora, then the one line", "the one line, then lora"])
def test_all_linear_lora_planned_on_first_call_trains_like_peft_under_autocast(order):
    """``target_modules="all-linear"`` LoRA on a Llama in block mode, applied before or
    after ``amp_rewrite(..., inplace=True)``: PEFT casts a bf16 activation up to the adapter
    weight's FP32 before ``lora_A`` (``_cast_input_dtype``), a node only the autocast trace
    has, so the two traces did not align and the block kept the FP32 trace's
    ``result.to(torch.float32)``: the MLP's SiLU ran in FP32 where autocast runs bf16 (loss
    off by 2e-4). That cast feeds only a Linear, which autocast casts to bf16 anyway, so
    the alignment passes over it; 3 AdamW steps equal autocast's, every gradient too."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0,
                             init_lora_weights=False)
    base = _llama()
    ref = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    cfg = fxamp.RewriteConfig.make(dtype=BF16, target="cpu")
    if order.startswith("lora"):
        model = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
        model.load_state_dict(ref.state_dict())
        fxamp.amp_rewrite(model, config=cfg, inplace=True)
    else:
        inner = copy.deepcopy(base)
        fxamp.amp_rewrite(inner, config=cfg, inplace=True)
        model = peft.get_peft_model(inner, copy.deepcopy(config))
        model.load_state_dict(ref.state_dict())
    ids = _ids()
    for (loss, grads), (ref_loss, ref_grads) in zip(*_three_steps(model, ref, ids)):
        assert loss == ref_loss and grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), [
            n for n in grads if not torch.equal(grads[n], ref_grads[n])]
