"""Block mode's glue (the model's own forward between its blocks) is a region planned like
any graph where torch.fx takes it: it has plan lines, a hand-written loss there runs in FP32
(rule ``loss``), and it computes what the flat plan of the same model computes. Where fx
does not take it, it runs under torch.autocast and the plan header says why."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import fxamp
from _block_nets import Block, Holds, InFp32, Net, copied, tiny_llama

BF16 = torch.bfloat16


class LossNet(Net):
    """:class:`Net` with a hand-written squared loss in its own forward, on bf16 values."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return ((out - y.to(out.dtype)) ** 2).mean()


def _config() -> fxamp.RewriteConfig:
    return fxamp.RewriteConfig.make(dtype=BF16, target="cpu")


def _rewritten(make) -> tuple:
    """A seeded model from ``make`` and a copy of it rewritten in block mode."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=_config(), inplace=True)
    return ref, model


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    rows = 2 + step  # (a batch size that changes every step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 2, generator=g) * 1e-3


def _steps(model: nn.Module, steps: int = 3, autocast: bool = False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = model(*_batch(step))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def test_a_hand_written_loss_in_the_glue_runs_in_fp32_as_in_the_flat_plan():
    torch.manual_seed(0)
    ref = LossNet()
    blocks, flat = copy.deepcopy(ref), copy.deepcopy(ref)
    fxamp.amp_rewrite(blocks, config=_config(), inplace=True)
    fxamp.amp_rewrite(flat, _batch(0), _config(), inplace=True)
    losses, grads = _steps(blocks)
    flat_losses, flat_grads = _steps(flat)
    auto_losses, _ = _steps(copy.deepcopy(ref), autocast=True)
    plan = fxamp.plan_of(blocks)
    assert plan.header["glue"].startswith("the model's own forward, traced by torch.fx")
    assert {name: p.rule for name, p in plan.nodes.items() if "/" not in name and
            name not in ("blocks.0", "blocks.1", "blocks.2")} == {
        "x": "autocast", "y": "autocast", "stem": "autocast", "head": "autocast",
        "to": "autocast", "sub": "autocast", "pow_1": "loss", "mean": "loss"}
    assert plan.nodes["pow_1"].inputs == torch.float32
    # the block plan computes what the flat plan computes, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(losses, flat_losses))
    assert all(torch.equal(a, b) for g, h in zip(grads, flat_grads) for a, b in zip(g, h))
    # and autocast, which squares the bf16 residuals, does not (residuals near 1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(losses, auto_losses))


def test_the_glue_trains_like_autocast_where_no_rule_applies():
    ref, model = _rewritten(Net)

    def steps(m: nn.Module, autocast: bool):
        out = []
        for step in range(3):
            m.zero_grad()
            x, _ = _batch(step)
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                y = m(x)
            y.float().pow(2).mean().backward()
            out.append((y.detach().float(), [p.grad.clone() for p in m.parameters()]))
        return out

    for (y, g), (y_ref, g_ref) in zip(steps(model, False), steps(ref, True)):
        assert torch.equal(y, y_ref)
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert [name for name, p in fxamp.plan_of(model).nodes.items()
            if "/" not in name] == ["x", "stem", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_a_first_call_in_eval_without_grad_then_training_plans_the_glue_per_mode():
    torch.manual_seed(0)
    ref = LossNet()
    model, flat = copy.deepcopy(ref), copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=_config(), inplace=True)
    fxamp.amp_rewrite(flat, _batch(0), _config(), inplace=True)
    model.eval()
    with torch.no_grad():
        first = model(*_batch(5))
    model.train()
    losses, grads = _steps(model)
    flat_losses, flat_grads = _steps(flat)
    assert first.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(losses, flat_losses))
    assert all(torch.equal(a, b) for g, h in zip(grads, flat_grads) for a, b in zip(g, h))
    assert fxamp.graphs_of(model)[""] == [  # (the glue's graphs: eval, then train)
        "eval mode, floating inputs float32, float32: the first call",
        "train mode, floating inputs float32, float32: a mode, call structure or input dtypes "
        "no graph was planned for"]


def test_a_replaced_block_is_called_by_the_glue_planned_again():
    torch.manual_seed(0)
    model = Net()
    fxamp.amp_rewrite(model, config=_config(), inplace=True)
    x = torch.randn(3, 8)
    model(x)
    model.blocks[1] = Block()
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        block.__dict__.pop("forward", None)  # (its plain FP32 forward, under autocast below)
    ref.__dict__.pop("forward", None)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x)
    assert torch.equal(model(x), want.float())


def test_where_fx_does_not_take_the_glue_it_runs_under_autocast_and_the_plan_says_why(
        caplog):
    pytest.importorskip("transformers")
    model = tiny_llama()
    fxamp.amp_rewrite(model, config=_config(), inplace=True)
    with caplog.at_level(logging.INFO, logger="fxamp"):
        model(torch.randint(0, 128, (2, 8)))
    glue = fxamp.plan_of(model).header["glue"]
    assert glue.startswith("the model's own forward under torch.autocast (torch.fx cannot "
                           "trace it: ")
    assert "LlamaForCausalLM" in glue
    assert fxamp.graphs_of(model)[""] == ["runs under torch.autocast: " + glue[
        len("the model's own forward under torch.autocast ("):-1]]
    assert "planning its glue (its own forward around its regions) on this call" in caplog.text


def test_planning_inside_a_users_autocast_region_leaves_no_fake_cast_in_its_cache():
    """The glue is planned on fake tensors under autocast; a module held outside the tree
    has real Parameters there, and autocast's cast cache, which lives as long as the
    user's outer region, kept their fake casts for the user's real ops."""
    torch.manual_seed(0)
    model = Holds()
    ref = copy.deepcopy(model)
    fxamp.amp_rewrite(model, config=_config(), inplace=True)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        out = model(x)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x)
    assert type(out) is torch.Tensor
    assert torch.equal(out, want.float())


def test_an_override_of_a_glue_module_changes_exactly_its_line_as_in_the_flat_plan():
    torch.manual_seed(0)
    ref = LossNet()
    plain, model, flat = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    config = fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:head")
    fxamp.amp_rewrite(plain, config=_config(), inplace=True)
    fxamp.amp_rewrite(model, config=config, inplace=True)
    fxamp.amp_rewrite(flat, _batch(0), config, inplace=True)
    losses, grads = _steps(model)
    flat_losses, flat_grads = _steps(flat)
    _steps(plain, 1)
    after, before = fxamp.plan_of(model).nodes, fxamp.plan_of(plain).nodes
    # the head and what follows it: the loss's terms are FP32 already (no rule needed)
    assert {n for n in after if after[n] != before[n]} == {"head", "to", "sub", "pow_1", "mean"}
    assert (after["head"].rule, after["head"].dtype) == ("user", torch.float32)
    assert all(after[n].dtype == torch.float32 for n in ("to", "sub"))
    assert [after[n].rule for n in ("pow_1", "mean")] == ["autocast", "autocast"]
    assert all(torch.equal(a, b) for a, b in zip(losses, flat_losses))
    assert all(torch.equal(a, b) for g, h in zip(grads, flat_grads) for a, b in zip(g, h))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_model_with_a_planned_glue_plans_its_own_and_computes_the_same(how):
    torch.manual_seed(0)
    model = Net()
    fxamp.amp_rewrite(model, config=_config(), inplace=True)
    x = torch.randn(3, 8)
    want = model(x)
    twin = copied(model, how)
    assert torch.equal(twin(x), want)
    assert fxamp.graphs_of(twin)[""] == ["train mode, floating inputs float32: the first call"]
    glue = twin.__dict__["forward"].glue.first
    assert all(m is twin.get_submodule(p) for p, m in glue.named_modules()
               if p.startswith("blocks.") and p.count(".") == 1)  # (the copy's own blocks)


def test_threads_making_the_first_call_at_once_plan_one_glue():
    import threading

    ref, model = _rewritten(Net)
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    outs: dict = {}
    start = threading.Barrier(len(xs))

    def call(i: int) -> None:
        start.wait()
        outs[i] = model(xs[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(xs):
        with torch.autocast("cpu", dtype=BF16):
            assert torch.equal(outs[i], ref(x).float())
    assert fxamp.graphs_of(model)[""] == ["train mode, floating inputs float32: the first call"]


def test_the_whole_model_compiled_plans_the_glue_outside_the_trace_and_trains_like_autocast():
    """torch.compile of the model (aot_eager): the glue and the blocks are planned on the
    first call, eagerly, outside the traced region; the region calls are plain module
    calls, so no graph break falls inside an autocast context of fxamp's."""
    ref, model = _rewritten(Net)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(3):
        x, _ = _batch(step)
        out = compiled(x)
        out.float().pow(2).mean().backward()
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x)
        want.float().pow(2).mean().backward()
        assert torch.equal(out, want.float())
        assert all(torch.equal(p.grad, q.grad)
                   for p, q in zip(model.parameters(), ref.parameters()))
    assert fxamp.graphs_of(model)[""] == ["train mode, floating inputs float32: the first call"]


class FlagNet(Net):
    """A glue branching on a Python bool and scaling by a Python float."""

    def forward(self, x: torch.Tensor, scale: float = 1.0, double: bool = False):
        out = super().forward(x) * scale
        if double:
            out = out * 2
        return out


def test_a_glue_branching_on_python_values_is_planned_per_value_and_reuses_each_graph():
    """fx cannot trace the branch with the bool as a symbol: the glue is traced with the
    call's Python scalars as constants, each value a graph of its own, checked on entry."""
    ref, model = _rewritten(FlagNet)
    calls = [(1.0, False), (2.0, True), (1.0, False), (2.0, True), (1.0, True)]
    for step, values in enumerate(calls):
        x, _ = _batch(step)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x, *values)
        assert torch.equal(model(x, *values), want.float()), values
    assert fxamp.plan_of(model).header["glue"].startswith(
        "the model's own forward, traced by torch.fx")
    made = fxamp.graphs_of(model)[""]
    assert len(made) == 3  # (one per distinct pair of values)
    assert "FlagNet was called with 'scale' = 2.0" in made[1]


def test_the_plan_made_ahead_on_an_example_equals_the_lazy_first_calls_glue_included():
    torch.manual_seed(0)
    ref = LossNet()
    ahead, lazy = copy.deepcopy(ref), copy.deepcopy(ref)
    config = fxamp.RewriteConfig.make(dtype=BF16, target="cpu", partition="blocks")
    fxamp.amp_rewrite(ahead, _batch(0), config, inplace=True)
    fxamp.amp_rewrite(lazy, config=config, inplace=True)
    lazy(*_batch(0))
    text = fxamp.plan_of(ahead).to_text()
    assert text == fxamp.plan_of(lazy).to_text()
    assert "pow_1" in text and "hand-written loss" in text
    losses, grads = _steps(ahead)
    lazy_losses, lazy_grads = _steps(lazy)
    assert all(torch.equal(a, b) for a, b in zip(losses, lazy_losses))
    assert all(torch.equal(a, b) for g, h in zip(grads, lazy_grads) for a, b in zip(g, h))


class TupleBlock(Block):
    """A :class:`Block` returning a tuple, as Hugging Face layers do."""

    def forward(self, x: torch.Tensor):
        y = super().forward(x)
        return y, y.sum()


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([TupleBlock() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x, _ = block(x)
        return self.head(x)


def test_a_region_whose_plan_gives_another_dtype_than_autocast_is_cast_for_its_consumers():
    """Block 2's override keeps its output in FP32 where autocast (the glue's view of it
    while planned) gives bf16: the head's cast of that tuple item is kept, so the glue
    computes what the flat plan of the same policy computes."""
    torch.manual_seed(0)
    ref = TupleNet()
    model, flat = copy.deepcopy(ref), copy.deepcopy(ref)
    config = fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:blocks.2.fc2")
    fxamp.amp_rewrite(model, config=config, inplace=True)
    fxamp.amp_rewrite(flat, (torch.randn(2, 8),), config, inplace=True)
    for step in range(2):
        x, _ = _batch(step)
        out, want = model(x), flat(x)
        assert torch.equal(out, want)
        out.pow(2).mean().backward()
        want.pow(2).mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                          flat.parameters()))
    assert fxamp.plan_of(model).nodes["blocks.2/fc2"].rule == "user"


def test_hooks_added_after_the_first_call_fire_on_a_glue_module_and_on_a_block():
    ref, model = _rewritten(Net)
    x = torch.randn(3, 8)
    model(x)
    seen = []
    model.stem.register_forward_hook(lambda m, a, out: seen.append("stem"))
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.append("blocks.1"))
    out = model(x)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x)
    assert seen == ["stem", "blocks.1"]
    assert torch.equal(out, want.float())
    assert fxamp.graphs_of(model)[""][-1].startswith("train mode, floating inputs float32: "
                                                     "hooks were registered on stem")


class TiedLM(nn.Module):
    """Token embedding, residual blocks, and a head tied to the embedding (GPT-2's)."""

    def __init__(self, vocab: int = 50, d: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.ln = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.linear(self.ln(x), self.wte.weight)


def test_a_tied_head_trains_like_autocast_on_batches_of_changing_length_with_one_glue():
    ref, model = _rewritten(TiedLM)

    def steps(m: nn.Module, autocast: bool):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(4):
            ids = torch.randint(0, 50, (2, 5 + 3 * step),
                                generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                logits = m(ids)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     ids.flatten())
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, [p.detach().clone() for p in m.parameters()]

    (losses, params), (want, want_params) = steps(model, False), steps(ref, True)
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert fxamp.graphs_of(model)[""] == ["train mode, floating inputs none: the first call"]


@pytest.mark.parametrize("override", ["fp32:nn.Linear", "fp32:operator.sub"],
                         ids=["blocks-and-glue", "glue-only"])
def test_an_op_label_override_reaches_the_blocks_and_the_glue_as_in_the_flat_plan(override):
    # (nn.Linear: the stem and head in the glue and each block's fc1 and fc2; operator.sub:
    # the loss's difference, in the glue alone: given to the blocks only, it was refused)
    torch.manual_seed(0)
    ref = LossNet()
    model, flat = copy.deepcopy(ref), copy.deepcopy(ref)
    config = fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy=override)
    fxamp.amp_rewrite(model, config=config, inplace=True)
    fxamp.amp_rewrite(flat, _batch(0), config, inplace=True)
    losses, grads = _steps(model)
    flat_losses, flat_grads = _steps(flat)
    mine, theirs = fxamp.plan_of(model).nodes, fxamp.plan_of(flat).nodes
    label = override.split(":", 1)[1]
    changed = [n for n, p in theirs.items() if p.op == label]
    assert changed and all(theirs[n].dtype == torch.float32 for n in changed)
    glue = [n for n in changed if not n.startswith("blocks_")]
    assert glue and all((mine[n].rule, mine[n].dtype) == ("user", torch.float32) for n in glue)
    assert all(torch.equal(a, b) for a, b in zip(losses, flat_losses))
    assert all(torch.equal(a, b) for g, h in zip(grads, flat_grads) for a, b in zip(g, h))


def test_an_op_label_override_matching_no_region_is_refused_on_every_call():
    model = LossNet()
    config = fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="fp32:nn.Conv2d")
    fxamp.amp_rewrite(model, config=config, inplace=True)
    for _ in range(2):
        with pytest.raises(fxamp.PolicyError, match="'fp32:nn.Conv2d' matches no node of "
                                                    "LossNet's blocks or glue"):
            model(*_batch(0))


def test_a_hook_on_a_block_computes_under_autocast_as_around_the_models_own_forward():
    # (the hook's matmul of the block's output: bf16 under autocast, as in the model run
    # under autocast; the block's own graph turns autocast off inside)
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    w = torch.randn(8, 8) * 0.1
    seen = []

    def hook(module, args, out):
        mixed = torch.mm(out, w)
        seen.append(mixed.dtype)
        return out + mixed

    for net in (ref, model):
        net.blocks[1].register_forward_hook(hook)
    fxamp.amp_rewrite(model, config=_config(), inplace=True)
    for net, autocast in ((ref, True), (model, False)):
        net.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = net(torch.randn(3, 8, generator=torch.Generator().manual_seed(1)))
        out.float().pow(2).mean().backward()
        if autocast:
            want, grads = out, [p.grad.clone() for p in ref.parameters()]
    assert seen == [BF16, BF16]
    # (planned, not run under autocast: outside it the hook's mm of the block's bf16 output
    # and an FP32 weight raised, and the glue fell back to autocast)
    assert fxamp.graphs_of(model)[""] == ["train mode, floating inputs float32: the first call"]
    assert torch.equal(out, want.float())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


class _Pair(nn.Module):
    """A block returning a tuple, both items taken by the glue's add without a cast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = self.fc(x)
        return h, h * 2


class _PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Pair() for _ in range(2)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, aux = block(x)
        return self.head(x + aux)


def test_a_region_whose_plan_changes_its_outputs_dtype_flows_through_the_glue_like_autocast():
    """``fp32:blocks.1.*`` makes block 1's outputs FP32 where the traced glue was planned
    with autocast's bf16: the glue's add took them without a cast, and the head's linear,
    its input cast left out as the plan said bf16, got FP32 against bf16 weights, so the
    glue's first run failed and it fell back to autocast. What ops that follow their inputs
    make of a region's outputs keeps every cast now (a no-op where the plan holds): the
    glue stays planned, and a step equals autocast with block 1 in FP32, bit for bit."""
    torch.manual_seed(0)
    ref = _PairNet()
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(
        policy="compute=bf16,target=cpu,fp32:blocks.1.*"), inplace=True)
    ref.blocks[1] = InFp32(ref.blocks[1])
    x = torch.randn(4, 8)
    loss = model(x).float().pow(2).mean()
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x).float().pow(2).mean()
    loss.backward(), want.backward()
    assert torch.equal(loss, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    plan = fxamp.plan_of(model)
    assert plan.header["glue"].startswith("the model's own forward, traced by torch.fx")
    assert plan.nodes["blocks.1/fc"].dtype == torch.float32
    assert plan.nodes["head"].dtype == BF16
    # the glue's lines for what it makes of block 1's outputs give the dtype they compute
    # in (FP32), as the flat plan's lines of the same policy do
    torch.manual_seed(0)
    flat = _PairNet()
    fxamp.amp_rewrite(flat, (x,), fxamp.RewriteConfig.make(
        policy="compute=bf16,target=cpu,fp32:blocks.1.*", partition="flat"), inplace=True)
    assert plan.nodes["add"].dtype == fxamp.plan_of(flat).nodes["add"].dtype == torch.float32
    assert plan.nodes["getitem_2"].dtype == plan.nodes["getitem_3"].dtype == torch.float32
    assert plan.nodes["getitem"].dtype == BF16  # (block 0's: bf16, as autocast's)
