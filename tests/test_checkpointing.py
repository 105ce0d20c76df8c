"""torch.utils.checkpoint regions survive the rewrite: the same memory saving, the recompute,
and the gradients of the same model under ``torch.autocast("cpu", torch.bfloat16)``.

Each test rewrites a small model and runs it next to a deepcopy under autocast: equal
losses, gradients for the same parameters and equal gradients (bit for bit unless stated),
saved-for-backward bytes (summed with ``saved_tensors_hooks``) no more than autocast's, and
the recompute counted by forward pre-hooks (a hook on the checkpointed module under
autocast, on the region's body in the rewrite; forward hooks would miss the non-reentrant
recompute, which stops early).
"""
from __future__ import annotations

import copy
import functools
import logging
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import fxamp
from fxamp.frontends.checkpoint_regions import CheckpointRegion

BF16 = torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")


class Block(nn.Module):
    def __init__(self, d: int = 32, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        return F.dropout(h, self.p, self.training)


class Blocks(nn.Module):
    """Four residual MLP blocks, each called through ``checkpoint``."""

    def __init__(self, reentrant: bool, p: float = 0.0, **options) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(p=p) for _ in range(4))
        self.head = nn.Linear(32, 10)
        self.options = dict(options, use_reentrant=reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + ckpt.checkpoint(block, x, **self.options)
        return self.head(x)


def saved_bytes(fn: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """``fn()`` and the bytes of the tensors autograd saved for backward meanwhile."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def regions(gm: nn.Module) -> List[CheckpointRegion]:
    return [m for m in gm.modules() if isinstance(m, CheckpointRegion)]


def counter(modules: List[nn.Module]) -> List[int]:
    """A count of the modules' forward calls (pre-hooks: recomputes included)."""
    count = [0]
    for module in modules:
        module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(gm: nn.Module, ref: nn.Module, atol: float = 0.0) -> None:
    mine, theirs = grads(gm), grads(ref)
    assert sorted(mine) == sorted(theirs)
    for name, g in mine.items():
        if atol == 0.0:
            assert torch.equal(g, theirs[name]), name
        else:
            torch.testing.assert_close(g, theirs[name], rtol=0, atol=atol, msg=name)


def step(model: nn.Module, x: torch.Tensor, autocast: bool, seed: int = 0
         ) -> Tuple[torch.Tensor, int]:
    """One forward (saved bytes counted) and the backward of a scalar loss."""
    torch.manual_seed(seed)
    with torch.autocast("cpu", BF16, enabled=autocast):
        out, nbytes = saved_bytes(lambda: model(x))
    loss = out.float().square().mean()
    loss.backward()
    return loss.detach(), nbytes


def train_side_by_side(gm: nn.Module, ref: nn.Module, x: torch.Tensor, steps: int = 2,
                       atol: float = 0.0) -> int:
    """``steps`` SGD steps of both; equal losses and gradients each step (the last step's
    left in ``.grad``). The rewrite's saved bytes (no more than autocast's)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (gm, ref)]
    for i in range(steps):
        loss, nbytes = step(gm, x, False, seed=i)
        ref_loss, ref_bytes = step(ref, x, True, seed=i)
        assert torch.equal(loss, ref_loss)
        assert nbytes <= ref_bytes, (nbytes, ref_bytes)
        assert_same_grads(gm, ref, atol)
        if i + 1 < steps:  # (the last step's gradients are left for the caller)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return nbytes


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_keep_their_memory_saving_and_gradients(frontend, reentrant):
    torch.manual_seed(0)
    model = Blocks(reentrant)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 32, requires_grad=True)  # (reentrant: an input needing grad)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend=frontend))
    assert len(regions(gm)) == 4
    assert all(r.options["use_reentrant"] is reentrant for r in regions(gm))
    plan = fxamp.plan_of(gm)
    assert any(p.module.startswith("blocks.3") and p.dtype == BF16 for p in plan.nodes.values())
    mine = counter([r.body for r in regions(gm)])
    theirs = counter(list(ref.blocks))
    nbytes = train_side_by_side(gm, ref, x)
    assert mine[0] == theirs[0] == 2 * 2 * 4  # two steps: forward and recompute of each
    assert len(grads(gm)) == 26
    with torch.autocast("cpu", BF16):  # without checkpoint every block's activations
        _, plain_bytes = saved_bytes(lambda: unchecked(ref, x))
    assert nbytes * 4 < plain_bytes


def unchecked(model: Blocks, x: torch.Tensor) -> torch.Tensor:
    for block in model.blocks:
        x = x + block(x)
    return model.head(x)


def test_reentrant_without_an_input_needing_grad_loses_the_same_gradients():
    """torch's reentrant checkpoint gives no gradient into a block whose inputs need none
    (it warns); the rewrite does exactly the same, not more."""
    torch.manual_seed(0)
    model = Blocks(reentrant=True)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 32)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend="fx"))
    with pytest.warns(UserWarning, match="requires_grad"):
        train_side_by_side(gm, ref, x, steps=1)
    assert sorted(grads(gm)) == ["head.bias", "head.weight"]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_dropout_recompute_draws_the_same_masks(frontend):
    """preserve_rng_state: the recompute replays the forward's dropout masks."""
    torch.manual_seed(0)
    model = Blocks(reentrant=False, p=0.3)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 32, requires_grad=True)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend=frontend))
    train_side_by_side(gm, ref, x)


def test_weights_cast_every_forward():
    """The policy without the weight cache (weights=cast) keeps the regions too."""
    torch.manual_seed(0)
    model = Blocks(reentrant=True)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 32, requires_grad=True)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(policy="compute=bf16,target=cpu,weights=cast",
                                                    frontend="fx"))
    assert len(regions(gm)) == 4
    train_side_by_side(gm, ref, x)


@pytest.mark.filterwarnings("ignore:A saved_tensors_hooks context")  # (the byte count's)
def test_selective_checkpointing_context_fn_is_kept():
    def policy(ctx, op, *args, **kwargs):
        return (ckpt.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default
                else ckpt.CheckpointPolicy.PREFER_RECOMPUTE)

    context_fn = functools.partial(ckpt.create_selective_checkpoint_contexts, policy)
    torch.manual_seed(0)
    model = Blocks(reentrant=False, context_fn=context_fn)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 32, requires_grad=True)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend="export"))
    assert all(r.options["context_fn"] is context_fn for r in regions(gm))
    train_side_by_side(gm, ref, x)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Shapes(nn.Module):
    """Nested regions, checkpoint_sequential, keyword arguments, tuple outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = Small(), Small()
        self.seq = nn.Sequential(Small(), Small(), Small())
        self.scaled = Small()
        self.head = nn.Linear(32, 4)

    def nested(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(ckpt.checkpoint(self.inner, x, use_reentrant=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = ckpt.checkpoint(self.nested, x, use_reentrant=False)
        x = ckpt.checkpoint_sequential(self.seq, 2, x, use_reentrant=False)
        scale = torch.sigmoid(x.sum(-1, keepdim=True))
        x = ckpt.checkpoint(lambda t, s: self.scaled(t) * s, x, use_reentrant=False, s=scale)
        a, b = ckpt.checkpoint(lambda t: (self.scaled(t), t.sin()), x, use_reentrant=True)
        return self.head(a + b)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_nested_sequential_keyword_and_tuple_regions(frontend):
    torch.manual_seed(0)
    model = Shapes()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 32, requires_grad=True)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend=frontend))
    names = [n for n, m in gm.named_modules() if isinstance(m, CheckpointRegion)]
    assert len(names) == 5 and "fxamp_checkpoint_0.body.fxamp_checkpoint_0" in names
    train_side_by_side(gm, ref, x)


class Untraceable(nn.Module):
    """A root forward no tracer takes (a branch on a value) calling checkpoint itself."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Small(), Small()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:
            x = x + ckpt.checkpoint(self.first, x, use_reentrant=True)
        return x + ckpt.checkpoint(self.second, x, use_reentrant=False)


def test_eager_root_runs_its_own_checkpoint_calls():
    torch.manual_seed(0)
    model = Untraceable()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 32, requires_grad=True)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    assert fxamp.plan_of(gm).header["frontend"] == "eager"
    mine, theirs = counter([gm.first, gm.second]), counter([ref.first, ref.second])
    train_side_by_side(gm, ref, x)
    assert mine[0] == theirs[0] == 2 * 2 * 2  # two steps, two blocks, and recompute


def test_state_dict_and_deepcopy_unchanged():
    model = Blocks(reentrant=False)
    x = torch.randn(4, 32)
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend="fx"))
    assert list(gm.state_dict()) == list(model.state_dict())
    assert all(not list(r.parameters()) and not list(r.buffers()) for r in regions(gm))
    twin = copy.deepcopy(gm)
    assert torch.equal(twin(x), gm(x)) and len(regions(twin)) == 4


def test_audit_reads_the_region_nodes():
    class Odd(nn.Module):  # out_features 30: not a multiple of 8
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 30)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ckpt.checkpoint(self.lin, x, use_reentrant=False)

    findings = fxamp.audit(Odd(), (torch.randn(4, 32),), fxamp.RewriteConfig.make(
        dtype=BF16, target="cpu", frontend="fx"))
    assert any(f.code == "dims-not-multiple-of-8" for f in findings)


# -- HF transformers: gradient_checkpointing_enable() ---------------------------------------

def tiny_bert(reentrant: "bool | None", layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, vocab_size=100, max_position_embeddings=32,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    if reentrant is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


def bert_step(model: nn.Module, ids: torch.Tensor, autocast: bool) -> Tuple[torch.Tensor, int]:
    labels = torch.tensor([0, 1])
    with torch.autocast("cpu", BF16, enabled=autocast):
        out, nbytes = saved_bytes(lambda: model(ids))
    loss = F.cross_entropy(out.logits.float(), labels)
    loss.backward()
    return loss.detach(), nbytes


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing(reentrant):
    """Every parameter gets its gradient (before: 37 of 41 got none with the reentrant
    variant, silently), and checkpointing is kept (before: gone with the non-reentrant one).

    Both bit for bit autocast's: the one cast of the hidden states feeding the query, key
    and value projections sums their gradients in fp32 as autocast's three casts do
    (runtime.fan_out), and in the reentrant recompute (detached inputs, leaves needing
    grad, whose one cast autocast caches and shares) in bf16, as autocast does."""
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    model = tiny_bert(reentrant)
    ref = copy.deepcopy(model)
    gm = fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    found = regions(gm)
    assert len(found) == 2 and all(r.options["use_reentrant"] is reentrant for r in found)
    mine = counter([r.body for r in found])
    theirs = counter([layer.attention for layer in ref.bert.encoder.layer])
    loss, nbytes = bert_step(gm, ids, autocast=False)
    ref_loss, ref_bytes = bert_step(ref, ids, autocast=True)
    assert torch.equal(loss, ref_loss)
    assert nbytes <= ref_bytes, (nbytes, ref_bytes)
    assert mine[0] == theirs[0] == 4  # each layer's forward and recompute
    assert len(grads(gm)) == 41
    assert_same_grads(gm, ref, atol=0.0)
    if not reentrant:
        plain = tiny_bert(None)
        bert_step(fxamp.amp_rewrite(plain, (ids,),
                                    fxamp.RewriteConfig.make(dtype=BF16, target="cpu")), ids, False)
        assert_same_grads(gm, plain)


@pytest.mark.slow
def test_hf_inplace_rewrite_follows_the_models_mode():
    """inplace=True (one graph of the whole model): the model itself computes with the
    rewrite; its train()/eval() decide whether the regions checkpoint (HF layers: train mode
    only)."""
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    model = tiny_bert(True, layers=1)
    ref = copy.deepcopy(model)
    assert fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(
        dtype=BF16, target="cpu", partition="flat"), inplace=True) is model
    (region,) = regions(fxamp.rewritten(model))
    calls = counter([region.body])
    bert_step(model, ids, autocast=False)
    bert_step(ref, ids, autocast=True)
    assert_same_grads(model, ref)
    assert calls[0] == 2
    model.eval()
    bert_step(model, ids, autocast=False)
    assert calls[0] == 3  # no recompute


@pytest.mark.slow
def test_hf_model_rewritten_in_eval_mode_checkpoints_in_train_mode_only(caplog):
    """HF layers checkpoint only in train mode: the regions come from the train-mode
    trace and are skipped in eval mode; a rewrite under no_grad sees none and says so."""
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    model = tiny_bert(False, layers=1).eval()
    gm = fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    (region,) = regions(gm)
    assert region.modes == frozenset({True})
    calls = counter([region.body])
    gm.train()
    bert_step(gm, ids, autocast=False)
    assert calls[0] == 2
    gm.eval()
    bert_step(gm, ids, autocast=False)
    assert calls[0] == 3  # no recompute
    with caplog.at_level(logging.WARNING, "fxamp"), torch.no_grad():
        fxamp.amp_rewrite(tiny_bert(False, layers=1), (ids,),
                          fxamp.RewriteConfig.make(dtype=BF16, target="cpu"))
    assert "made no torch.utils.checkpoint call" in caplog.text


def test_reentrant_region_that_lost_its_arguments_is_refused():
    """The outliner alone, on a traced graph: a reentrant region whose argument marks are
    gone (a pass replaced the node) would give its inputs no gradient: refused."""
    from fxamp.errors import UnsupportedModelError
    from fxamp.frontends import checkpointing
    from fxamp.frontends.checkpoint_regions import outline
    from fxamp.frontends.fx import trace

    model = Blocks(reentrant=True)
    x = torch.randn(4, 32, requires_grad=True)
    kept = trace(model)
    assert outline(kept) == 4 and torch.equal(kept(x), model(x))
    gm = trace(model)
    for node in gm.graph.nodes:
        if checkpointing.arg_marks(node):
            node.meta["custom"] = {k: v for k, v in node.meta["custom"].items()
                                   if k != checkpointing.ARGS}
    with pytest.raises(UnsupportedModelError, match="use_reentrant=False"):
        outline(gm)
