"""Planned on first call, without surprises: what a graph planned on a call assumed (sizes it
fixed, Python values it holds, the dtypes of its floating inputs) is guarded, and a call that
misses it is planned again, with every dimension and Python int seen to change symbolic
(torch.compile's automatic dynamic), never refused. At most ``LIMIT`` graphs per module; past
that it runs under torch.autocast with one warning. A first call that fails keeps no plan.
Each test compares with the same model under torch.autocast, bit for bit."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.rewriter.inplace import LIMIT

BF16 = torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _plans(caplog) -> int:
    return caplog.text.count("planning it on this call")


def _grads(model: nn.Module) -> dict:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _same_grads(a: nn.Module, b: nn.Module) -> list:
    ga, gb = _grads(a), _grads(b)
    assert set(ga) == set(gb) == {k for k, p in a.named_parameters() if p.requires_grad}
    return [k for k in ga if not torch.equal(ga[k], gb[k])]


#: (batch, sequence) of the training steps, then of the evaluation batches
STEPS = [(2, 12), (3, 16), (2, 9), (4, 16), (1, 5), (2, 20)]
EVALS = [(5, 7), (1, 24), (3, 11)]


def _hf(name: str, cache: bool = False):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64,
                                      num_labels=3, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(cfg)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=cache)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "t5":
        cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                    num_heads=4, dropout_rate=0.0, use_cache=cache,
                                    decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(cfg)
    if name == "roberta":
        cfg = transformers.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64,
                                         num_labels=3, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, pad_token_id=0)
        return transformers.RobertaForSequenceClassification(cfg)
    kind = transformers.Qwen2Config if name == "qwen2" else transformers.LlamaConfig
    cfg = kind(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               use_cache=cache)
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(cfg)
    return transformers.LlamaForCausalLM(cfg)


def _batch(name: str, b: int, s: int, g: torch.Generator) -> dict:
    ids = torch.randint(1, 100, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if s > 2:
        mask[0, s // 2:] = 0  # (a padded row)
    if name in ("bert", "roberta"):
        return {"input_ids": ids, "attention_mask": mask, "labels": ids[:, 0] % 3}
    if name == "t5":
        labels = ids[:, : max(2, s // 2)].contiguous()
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.slow
@pytest.mark.parametrize("name,cache", [("bert", False), ("roberta", False), ("llama", False),
                                        ("llama", True), ("qwen2", False), ("qwen2", True),
                                        ("gpt2", False), ("t5", False)])
def test_batch_and_sequence_change_every_step_like_autocast(name, cache, caplog):
    """Six training steps of another batch size and padded length each, then three eval
    batches of other shapes: losses, every gradient and the logits equal autocast's; at most
    two more traces after the first step, per mode."""
    model = _hf(name, cache)
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    g = torch.Generator().manual_seed(3)
    caplog.set_level(logging.INFO, logger="fxamp")
    for step, (b, s) in enumerate(STEPS):
        batch = _batch(name, b, s, g)
        out = model(**batch)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(**batch)
        out.loss.backward()
        want.loss.backward()
        assert torch.equal(out.loss, want.loss), step
        assert not _same_grads(model, ref), step
        model.zero_grad()
        ref.zero_grad()
        if step == 0:
            first = _plans(caplog)
    train = _plans(caplog) - first
    assert train <= 2 * first, caplog.text  # (each distinct block: one more trace at most)
    model.eval()
    ref.eval()
    with torch.no_grad():
        for b, s in EVALS:
            batch = _batch(name, b, s, g)
            with torch.autocast("cpu", dtype=BF16):
                want = ref(**batch)
            assert torch.equal(model(**batch).logits, want.logits), (b, s)
    assert _plans(caplog) - first - train <= 2 * first


class _Scaled(nn.Module):
    """A block whose forward divides by a Python int (Hugging Face's num_items_in_batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, count: int) -> torch.Tensor:
        if x.shape[0] > 1:  # (fx cannot take it: the export front end plans it)
            x = x * 1.0
        return self.fc(x).sum(-1) / count


class _Net(nn.Module):
    def __init__(self, block: type = _Scaled) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x: torch.Tensor, value) -> torch.Tensor:
        return sum(b(x, value) for b in self.blocks)


def test_a_changing_int_makes_at_most_two_plans_in_twenty_steps(caplog):
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    caplog.set_level(logging.INFO, logger="fxamp")
    for step in range(20):
        x = torch.randn(4, 8)
        got = model(x, 100 + step)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x, 100 + step)
        assert torch.equal(got, want), step
        got.sum().backward()
        want.sum().backward()
        assert not _same_grads(model, ref)
    assert _plans(caplog) <= 2, caplog.text
    made = fxamp.graphs_of(model)  # (what each graph was made for, and why)
    assert list(made) == ["", "blocks.0", "blocks.1"]
    # (the glue, traced by fx, takes the int as an input: one graph)
    assert made[""] == ["train mode, floating inputs float32: the first call"]
    assert made["blocks.0"][0] == "train mode, floating inputs float32: the first call"
    assert len(made["blocks.0"]) == 2 and "'count'" in made["blocks.0"][1]
    assert "1 dimension(s) or int(s) symbolic" in made["blocks.0"][1]


class _Branching(nn.Module):
    """A block whose code branches on a Python float: each value is another graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if scale > 0.5:
            x = x.relu()
        return self.fc(x) * scale


def test_past_the_limit_a_block_runs_under_autocast_with_one_warning(caplog):
    torch.manual_seed(0)
    model = _Net(_Branching)
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    caplog.set_level(logging.INFO, logger="fxamp")
    x = torch.randn(4, 8)
    for step in range(LIMIT + 4):
        value = 0.25 + step / 8
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x, value)
        assert torch.equal(model(x, value), want), step
    assert _plans(caplog) <= 2 * LIMIT  # (two blocks, LIMIT graphs each at most)
    warned = [r for r in caplog.records if "runs under torch.autocast from now on" in
              r.getMessage()]
    assert len(warned) == 2 and "_Branching" in warned[0].getMessage()
    assert "scale" in warned[0].getMessage()  # (what kept changing)
    assert fxamp.graphs_of(model)["blocks.0"][-1].startswith(
        f"runs under torch.autocast from now on ({LIMIT} graphs)")


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _Mixed(nn.Module):
    """Block 0 gives block 1 a bf16 tensor; on a masked call the glue makes it FP32."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Linear(), _Linear()])

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        h = self.blocks[0](x)
        if mask is not None:
            h = h * mask  # (bf16 * fp32 under autocast: fp32)
        return self.blocks[1](h)


def test_a_block_called_with_other_input_dtypes_is_planned_for_them():
    torch.manual_seed(0)
    model = _Mixed()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    x, mask = torch.randn(4, 8), torch.rand(4, 8)
    for kwargs in ({}, {"mask": mask}, {}, {"mask": mask}):
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x, **kwargs)
        got = model(x, **kwargs)
        assert torch.equal(got.float(), want.float())  # (outputs in the policy's dtype)


def test_a_first_call_that_fails_keeps_no_plan():
    torch.manual_seed(0)
    model = _Net(_Linear_block := type("_Block", (_Linear,), {
        "forward": lambda self, x, value: self.fc(x)}))
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    ints = torch.randint(0, 4, (4, 8))
    with pytest.raises(RuntimeError) as theirs:
        with torch.autocast("cpu", dtype=BF16):
            ref(ints, 1)
    with pytest.raises(RuntimeError) as ours:
        model(ints, 1)
    assert type(ours.value) is type(theirs.value)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x, 1)
    assert torch.equal(model(x, 1), want)
    assert "_Block" in str(fxamp.plan_of(model))


def _train_steps(model: nn.Module, amp: bool, batches: list, loss_fn) -> list:
    """Three SGD steps: each step's loss and every gradient (None where none came)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step, batch in enumerate(batches):
        torch.manual_seed(100 + step)  # (the same dropout draws in both runs)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=amp):
            loss = loss_fn(model, batch)
        loss.float().backward()
        out.append((loss.detach().float(), {n: None if p.grad is None else p.grad.clone()
                                            for n, p in model.named_parameters()}))
        opt.step()
    return out


def _assert_same_steps(ours: list, theirs: list) -> None:
    for step, ((la, ga), (lb, gb)) in enumerate(zip(ours, theirs)):
        assert torch.equal(la, lb), step
        missing = [n for n in gb if ga[n] is None and gb[n] is not None]
        assert not missing, (step, missing)  # (every parameter trained)
        assert not [n for n in gb if gb[n] is not None and not torch.equal(ga[n], gb[n])], step


@pytest.mark.slow
def test_a_first_call_in_eval_without_grad_then_training_is_autocasts():
    """Lightning's sanity check: the demo Transformer's first call is an eval forward under
    no_grad (nn.Transformer's fused fast path under autocast), then it trains: the eval
    output, the losses and every gradient are autocast's."""
    demos = pytest.importorskip("lightning.pytorch.demos")
    import torch.nn.functional as F

    torch.manual_seed(0)
    ref = demos.Transformer(vocab_size=50, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.2)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 50, (4, 12), generator=g)
    target = torch.randint(0, 50, (4, 12), generator=g)
    evals = []
    for m in (ref, model):
        m.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=m is ref):
            evals.append(m(inputs, target).float())
        m.train()
    assert torch.equal(*evals)  # (the fused fast path, as autocast runs it)

    def loss(m, batch):
        return F.nll_loss(m(*batch).float(), batch[1].view(-1))

    batches = [(inputs, target)] * 3
    _assert_same_steps(_train_steps(model, False, batches, loss),
                       _train_steps(ref, True, batches, loss))


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _Checkpointed(nn.Module):
    """Each block run under torch.utils.checkpoint by the model's own forward."""

    def __init__(self, reentrant: bool, d: int = 32) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList([_Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocks_first_called_inside_a_checkpoint_train_like_autocast(reentrant):
    torch.manual_seed(0)
    ref = _Checkpointed(reentrant)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=g) for _ in range(3)]

    def loss(m, x):
        return m(x).float().pow(2).mean()

    _assert_same_steps(_train_steps(model, False, batches, loss),
                       _train_steps(ref, True, batches, loss))


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_trains_every_parameter_like_autocast(reentrant):
    model = _hf("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
                                                                       reentrant})
    model.train()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 100, (2, 16), generator=g) for _ in range(3)]

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss

    _assert_same_steps(_train_steps(model, False, batches, loss),
                       _train_steps(ref, True, batches, loss))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_per_layer_compile_before_the_first_call_trains_every_parameter(backend):
    """Regional compilation of a model planned on first call: each decoder layer's first
    call plans inside its compiled region (the planning traces the layer's own code, not the
    compiled call) and runs outside the trace; three steps like the same compiled stack
    under autocast, every parameter with its gradient."""
    model = _hf("llama")
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    for m in (model, ref):
        for layer in m.model.layers:
            layer.compile(backend=backend)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 100, (2, 16), generator=g) for _ in range(3)]

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss

    ours, theirs = (_train_steps(model, False, batches, loss),
                    _train_steps(ref, True, batches, loss))
    for step, ((la, ga), (lb, gb)) in enumerate(zip(ours, theirs)):
        assert not [n for n in gb if ga[n] is None], step  # (every parameter trained)
        # (the first call plans and runs outside the compiled region, as eager autocast
        # computes; a compiled backward rounds a bf16 sum in its own order: autocast's own
        # compiled stack differs from its eager one by as much)
        if backend == "aot_eager":
            assert torch.equal(la, lb), step
        else:  # (inductor fuses the two graphs differently: bf16 roundings, then SGD)
            assert torch.allclose(la, lb, rtol=0, atol=2e-3), step
        for n in gb:
            assert torch.allclose(ga[n], gb[n], rtol=2e-2, atol=2e-3), (step, n)


@pytest.mark.slow
def test_a_lightning_module_without_forward_is_refused_and_the_advice_trains_like_autocast():
    """The one line on a LightningModule whose steps call its submodule changed nothing:
    refused, naming the submodule; rewriting that submodule, as advised, trains under
    Lightning's Trainer (precision 32) like Lightning's bf16-mixed."""
    L = pytest.importorskip("lightning.pytorch")
    demos = pytest.importorskip("lightning.pytorch.demos")
    import torch.nn.functional as F

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = demos.Transformer(vocab_size=50, ninp=32, nhead=2, nhid=64,
                                           nlayers=2, dropout=0.0)
            self.losses: list = []

        def training_step(self, batch, index):
            x, y = batch
            loss = F.nll_loss(self.model(x, y).float(), y.view(-1))
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(fxamp.UnsupportedModelError, match=r"amp_rewrite\(module\.model,"):
        fxamp.amp_rewrite(Module(), config="compute=bf16", inplace=True)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 50, (4, 12), generator=g), torch.randint(0, 50, (4, 12),
                                                                         generator=g))
            for _ in range(3)]
    runs = []
    for precision in ("32-true", "bf16-mixed"):
        module = Module()
        if precision == "32-true":
            fxamp.amp_rewrite(module.model, config="compute=bf16", inplace=True)
        trainer = L.Trainer(max_steps=3, precision=precision, accelerator="cpu",
                            logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        trainer.fit(module, train_dataloaders=loader)
        runs.append(module.losses)
    assert len(runs[0]) == 3 and all(torch.equal(a, b) for a, b in zip(*runs))


class _Listed(nn.Module):
    """A block given ``[tensor, float]``: torch.export guards the float's value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, extra: list) -> torch.Tensor:
        t, f = extra
        if x.shape[0] > 1:  # (fx cannot take it: the export front end plans it)
            x = x * 1.0
        return self.fc(x) * f + t


class _ListedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Listed(), _Listed()])

    def forward(self, x: torch.Tensor, f: float) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, [x, f])
        return x


def test_a_float_in_a_list_that_changes_is_another_graph_not_an_error():
    torch.manual_seed(0)
    model = _ListedNet()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    x = torch.randn(4, 8)
    for f in (1.0, 2.0, 3.0, 2.0):
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x, f)
        assert torch.equal(model(x, f).float(), want.float()), f
    assert len(fxamp.graphs_of(model)["blocks.0"]) == 3
