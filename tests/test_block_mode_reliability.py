"""A model rewritten in place and planned on its calls, in every state fxamp leaves it in:
pickled and loaded (``torch.save``) before and after its first call, and asked about while
another thread plans it (``plan_of``, ``amp_rewrite``): the copy trains like the original,
and a message names what is really happening."""
from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import FxampError, NotPlannedError
from _block_nets import Block, Holding, Holds

BF16 = torch.bfloat16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _step(model: nn.Module, x: torch.Tensor, amp: bool = False):
    model.zero_grad()
    with torch.autocast("cpu", dtype=BF16, enabled=amp):
        out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach().float(), [p.grad.clone() for p in model.parameters()]


def _reloaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("called", [False, True])
def test_a_block_mode_model_pickles_and_the_copy_trains_like_autocast(called):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    x = torch.randn(4, 8)
    if called:
        _step(model, x)
    copied = _reloaded(model)
    out, grads = _step(copied, x)
    want, want_grads = _step(ref, x, amp=True)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert "blocks.0" in str(fxamp.plan_of(copied))


class Gated(nn.Module):
    """A block whose planning waits for a gate (the first run of its code, in the planning
    thread), so another thread can look at the model meanwhile."""

    def __init__(self, started: threading.Event, gate: threading.Event) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.started, self.gate = started, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gate.is_set():
            self.started.set()
            assert self.gate.wait(30)
        return self.fc(x)


def test_while_another_thread_plans_the_messages_say_so():
    started, gate = threading.Event(), threading.Event()
    torch.manual_seed(0)
    model = Gated(started, gate)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    errors: list = []

    def first_call() -> None:
        try:
            model(torch.randn(2, 8))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    worker = threading.Thread(target=first_call)
    worker.start()
    try:
        assert started.wait(30)
        with pytest.raises(NotPlannedError, match="being planned now, on a call in another"):
            fxamp.plan_of(model)
        with pytest.raises(FxampError, match="being planned now, on a call in another"):
            fxamp.amp_rewrite(model, config="compute=fp16", inplace=True)
    finally:
        gate.set()
        worker.join(60)
    assert not errors
    assert "fc" in str(fxamp.plan_of(model))


class Act(nn.Module):
    def __init__(self, act: str = "gelu") -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return torch.relu(y) if self.act == "relu" else torch.nn.functional.gelu(y)


class Acts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Act(), Act(), Act()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_block_replaced_after_the_first_call_is_planned_and_the_plan_says_so():
    torch.manual_seed(0)
    model = Acts()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    x = torch.randn(4, 8)
    model(x)
    old = model.blocks[1]
    torch.manual_seed(1)
    new = Act("relu")
    model.blocks[1], ref.blocks[1] = new, copy.deepcopy(new)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x)
    assert torch.equal(model(x).float(), want.float())
    assert "forward" in new.__dict__ and "forward" not in old.__dict__  # (rewritten; undone)
    text = str(fxamp.plan_of(model))
    assert "blocks.1/relu" in text and "blocks.1/gelu" not in text


def test_a_block_calling_an_unregistered_module_trains_every_parameter(caplog):
    """The module a block holds in a plain list got no gradient (its Parameters were
    constants in the block's graph): such a block runs under autocast, with a warning
    naming the attribute."""
    torch.manual_seed(0)
    model = Holds()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    x = torch.randn(4, 8)
    out, grads = _step(model, x)
    want, want_grads = _step(ref, x, amp=True)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert "extra[0] (Linear)" in caplog.text and "register them" in caplog.text
    assert fxamp.graphs_of(model)["blocks.0"][0].startswith("runs under torch.autocast")


class SharedFc(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.fc1 = shared
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_module_registered_in_several_blocks_is_named_in_one_warning(caplog):
    """Its gradients sum in FP32 (each block's graph casts on its own) where autocast's
    cast cache sums them in bf16: the documented limit is logged when it happens."""
    shared = nn.Linear(8, 8)
    model = nn.Sequential(SharedFc(shared), SharedFc(shared))
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    warned = [r.getMessage() for r in caplog.records if "registered in several" in
              r.getMessage()]
    assert len(warned) == 1 and "0.fc1, 1.fc1" in warned[0] and "cast cache" in warned[0]


def test_stored_weights_on_blocks_sharing_one_linear_evaluate_like_autocast():
    """weights=stored: block 0 stored the shared Linear's weight in bf16 while it was
    planned; block 1, planned next, was refused ('already torch.bfloat16 ... call
    model.float()') although the user's model is FP32."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(SharedFc(shared), SharedFc(shared)).eval()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config="compute=bf16,weights=stored", inplace=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x)
        assert torch.equal(model(x).float(), want.float())
        assert torch.equal(model(x).float(), want.float())
    assert model[0].fc1.weight.dtype == BF16  # (stored once, shared)


def test_rewritten_of_a_block_mode_model_names_the_blocks_and_the_advice_works():
    torch.manual_seed(0)
    model = Net()
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    model(torch.randn(4, 8))
    with pytest.raises(FxampError, match=r"block mode .*rewritten\(model.get_submodule"):
        fxamp.rewritten(model)
    gm = fxamp.rewritten(model.get_submodule("blocks.0"))
    assert "blocks.0" not in str(fxamp.plan_of(gm)) and gm is not model.blocks[0]


def test_a_module_hidden_from_the_whole_model_is_not_taken_for_an_unregistered_one(caplog):
    """A teacher held in a plain list and registered nowhere (hidden from parameters() on
    purpose) is no cause for autocast: the blocks are planned."""
    torch.manual_seed(0)
    teacher = nn.Linear(8, 8)
    model = nn.Sequential(Holding(teacher), Holding(teacher))
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    model(torch.randn(4, 8))
    assert "register them" not in caplog.text
    assert fxamp.graphs_of(model)["0"][0].endswith("the first call")


def test_deberta_v2_whose_layers_take_a_tensor_computed_with_grad_shares_and_trains():
    """DeBERTa-v2 (relative attention, ``norm_rel_ebd="layer_norm"``) passes every layer
    ``rel_embeddings``, a LayerNorm's output computed with grad. The first layer's plan
    kept the call's keyword values in its config, so the second layer's copy of it copied
    that tensor, which torch refuses for a non-leaf (``RuntimeError`` at step 0). A block's
    plan keeps none of its call's values; 2 steps equal autocast's, every gradient too."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, relative_attention=True,
        position_buckets=16, norm_rel_ebd="layer_norm", share_att_key=True,
        pos_att_type=["p2c", "c2p"], max_relative_positions=-1, num_labels=3,
        type_vocab_size=0)
    ref = transformers.DebertaV2ForSequenceClassification(cfg).train()
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2])
    fxamp.amp_rewrite(model, config="compute=bf16,target=cpu", inplace=True)
    for _ in range(2):
        torch.manual_seed(5)  # (dropout)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref(input_ids=ids, labels=labels).loss
        want.backward()
        assert torch.equal(loss, want)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), name
    assert "the same plan as deberta.encoder.layer.0" in \
        fxamp.plan_of(model).nodes["deberta.encoder.layer.2"].reason
