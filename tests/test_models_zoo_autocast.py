"""Zoo models the sweep (benchmarks/zoo.py) once refused or found different, against
``torch.autocast("cpu", torch.bfloat16)`` bit for bit: an in-place rewrite and a copy under
autocast, the same seeded training step (loss = sum of the FP32 outputs) and eval forward;
outputs, loss and every parameter gradient ``torch.equal``.

Random weights and tiny inputs; nothing is downloaded.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")           # never reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import copy  # noqa: E402
import contextlib  # noqa: E402
from typing import Any, Dict, List, Tuple  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.fx  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxamp  # noqa: E402
from fxamp.passes.annotate import float_leaves  # noqa: E402


def _step(model: nn.Module, args: tuple, kwargs: Dict[str, Any], autocast: bool
          ) -> Tuple[List[torch.Tensor], torch.Tensor]:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    model.train()
    torch.manual_seed(1)
    with ctx:
        out = model(*args, **kwargs)
    leaves = float_leaves(out)
    loss = sum((x.float().sum() for x in leaves), torch.zeros(()))
    loss.backward()
    return [x.detach().float() for x in leaves], loss.detach()


def _eval(model: nn.Module, args: tuple, kwargs: Dict[str, Any], autocast: bool
          ) -> List[torch.Tensor]:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    model.eval()
    torch.manual_seed(2)
    with torch.no_grad(), ctx:
        return [x.float() for x in float_leaves(model(*args, **kwargs))]


def assert_same_as_autocast(model: nn.Module, args: tuple = (),
                            kwargs: Dict[str, Any] = None, policy: str = None) -> nn.Module:
    """An in-place bf16 rewrite of a copy of ``model`` gives autocast's training-step outputs,
    loss and gradients and its eval outputs exactly; returns the rewritten copy."""
    kwargs = kwargs or {}
    ref, amp = copy.deepcopy(model), copy.deepcopy(model)
    ref_out, ref_loss = _step(ref, args, kwargs, autocast=True)
    ref_eval = _eval(ref, args, kwargs, autocast=True)
    fxamp.amp_rewrite(amp,
                      config=fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                      policy=policy), inplace=True)
    out, loss = _step(amp, args, kwargs, autocast=False)
    assert len(out) == len(ref_out)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, out))
    assert torch.equal(ref_loss, loss)
    for (name, p), q in zip(ref.named_parameters(), amp.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), \
            (name, float((p.grad - q.grad).abs().max()))
    got_eval = _eval(amp, args, kwargs, autocast=False)
    assert all(torch.equal(a, b) for a, b in zip(ref_eval, got_eval))
    return amp


# ---------------------------------------------------------------------------------------
# a torch.fx.wrap'ed function that writes into the lists it is given
# ---------------------------------------------------------------------------------------
def clip_sizes(sizes: List[int], limit: List[int]) -> List[int]:
    """Writes into ``sizes`` (as torchvision's ``_get_window_and_shift_size`` does)."""
    for i in range(len(sizes)):
        if limit[i] < sizes[i]:
            sizes[i] = limit[i]
    return sizes


torch.fx.wrap("clip_sizes")


class ClippedPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.window = [4, 4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        window = clip_sizes(list(self.window), [h, w])
        return nn.functional.avg_pool2d(self.conv(x), window)


def test_wrapped_function_writing_into_its_list_arguments():
    """fx's interpreter hands a call the node's immutable lists; fxamp's trial runs give it
    fresh lists, as the generated code does, so the call runs as it is (it was refused as
    failing "with the planned dtypes", though it has no floating input)."""
    torch.manual_seed(0)
    assert_same_as_autocast(ClippedPool(), (torch.randn(2, 3, 2, 6),))


@pytest.mark.slow
def test_torchvision_swin3d_t():
    """torchvision's video Swin: ``_get_window_and_shift_size`` (fx-wrapped, ints only) writes
    into its lists; small clips make the windows adapt to the input."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.video.swin3d_t(weights=None)
    assert_same_as_autocast(model, (torch.randn(1, 3, 4, 32, 32),))


# ---------------------------------------------------------------------------------------
# list-of-tensor arguments
# ---------------------------------------------------------------------------------------
class ListBlock(nn.Module):
    """Takes ``[x]`` or ``[x, skip]`` (or a tuple) and returns ``[y, skip]``, as timm's
    SelecSLS blocks do (``isinstance`` on the argument, then ``x[0]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: List[torch.Tensor], scale: float = 1.0) -> List[torch.Tensor]:
        if isinstance(x, torch.Tensor):
            x = [x]
        y = self.conv(x[0]) * scale
        skip = x[1] if len(x) > 1 else y
        return [y + skip, skip]


def test_list_of_tensors_argument_in_place():
    """A list argument is traced item by item (fx would trace it as one Proxy, so that
    ``x[0]`` is the whole list); a call with a list of another length or a tuple is another
    structure, planned on its call."""
    torch.manual_seed(0)
    a, b = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    model = ListBlock()
    amp = copy.deepcopy(model)
    fxamp.amp_rewrite(amp, config=fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"),
                      inplace=True)
    for call in ([a], [a, b], (a, b), [a]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model(call)
        got = amp(call)
        assert len(got) == 2 and all(torch.equal(r.float(), g) for r, g in zip(ref, got))
    assert_same_as_autocast(model, ([a, b],))


def test_list_of_tensors_argument_of_another_length_is_refused():
    """A returned module runs the list length it was traced for alone, and says so."""
    torch.manual_seed(0)
    a, b = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    gm = fxamp.amp_rewrite(ListBlock(), ([a],),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    assert gm([a])[0].shape == a.shape
    with pytest.raises(fxamp.CallStructureError, match=r"'x' a list of 2 \(tensor, tensor\)"
                       r".*'x' a list of 1 \(tensor\)"):
        gm([a, b])


@pytest.mark.slow
def test_timm_selecsls42():
    """timm's SelecSLS: its blocks take ``[x]`` or ``[x, skip]``."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("selecsls42", pretrained=False)
    assert_same_as_autocast(model, (torch.randn(2, 3, 64, 64),))


# ---------------------------------------------------------------------------------------
# custom autograd Functions: torch.export would drop their backward
# ---------------------------------------------------------------------------------------
class OwnBackward(torch.autograd.Function):
    """Its backward is not the derivative of its forward (as BLOOM's GeLUFunction's is
    another formula): a rewrite that inlines the forward trains with another gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3


class OwnAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OwnBackward.apply(x)


class RowLoop(nn.Module):
    """fx cannot trace it (``range`` of a traced size); torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(8, 8), OwnAct(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x))
        rows = [h[i] + i for i in range(x.shape[0])]
        return self.out(torch.stack(rows))


def test_export_refuses_a_custom_function_it_would_inline():
    torch.manual_seed(0)
    with pytest.raises(fxamp.TraceError, match=r"custom autograd Function .*OwnBackward "
                       r"\(applied in RowLoop\.act\).*drops its own backward"):
        fxamp.amp_rewrite(RowLoop(), (torch.randn(3, 8),),
                          fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                   frontend="export"))


def test_custom_function_keeps_its_backward():
    """``frontend="auto"``: export is refused, the next front end keeps the Function's call;
    its fp32 fence (rule custom_ops) names it, and without the fence the training step is
    autocast's bit for bit: the gradient is the Function's own backward's."""
    torch.manual_seed(0)
    model, x = RowLoop(), torch.randn(3, 8)
    amp = assert_same_as_autocast(model, (x,), policy="off:custom_ops")
    fenced = copy.deepcopy(model)
    fxamp.amp_rewrite(fenced, config=fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"),
                      inplace=True)
    fenced(x).sum().backward()
    line = next(p for p in fxamp.plan_of(fenced).nodes.values()
                if "OwnBackward" in p.op)
    assert (line.rule, line.dtype) == ("custom_ops", torch.float32)
    assert "OwnBackward.apply has no autocast rule" in line.reason
    why = fxamp.plan_of(fenced).nodes["lin"]
    assert (why.rule, why.reason.split(", planned")[0]) == (
        "nested", f"rewritten on its own (torch.fx cannot trace the model's forward, and "
        f"torch.export would drop the backward of the custom autograd Function "
        f"{__name__}.OwnBackward, applied in RowLoop.act)")
    assert amp.lin.weight.grad is not None


@pytest.mark.slow
def test_huggingface_bloom_training_keeps_gelu_backward():
    """BLOOM's BloomGelu applies GeLUFunction, whose backward is its own formula."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=2, vocab_size=1000,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(cfg)
    ids = torch.randint(5, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    assert_same_as_autocast(model, (), {"input_ids": ids, "attention_mask": mask},
                            policy="off:custom_ops")


def _with_rewrite(model: nn.Module, config: str = "compute=bf16,target=cpu"
                  ) -> Tuple[nn.Module, nn.Module]:
    """A copy of ``model`` to run under autocast, and a copy rewritten in place with the one
    line and ``config``."""
    ref, amp = copy.deepcopy(model), copy.deepcopy(model)
    fxamp.amp_rewrite(amp, config=config, inplace=True)
    return ref, amp


def _bloom_with_cache(hidden: int, heads: int, vocab: int, low: int, length: int
                      ) -> Tuple[nn.Module, torch.Tensor]:
    """A 2-layer BLOOM with its default ``use_cache=True`` (seeded) and 2 rows of ids."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BloomConfig(hidden_size=hidden, n_layer=2, n_head=heads,
                                   vocab_size=vocab)
    assert cfg.use_cache
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(cfg)
    ids = torch.randint(low, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    return model, ids


def test_huggingface_bloom_with_its_kv_cache_plans_each_block_on_copies():
    """BLOOM with its default ``use_cache=True`` passes one ``DynamicCache`` to every block;
    each block is planned on its first call, by the eager front end (torch.export would
    drop GeLUFunction's backward), whose runs of the block append to the cache. They run on
    copies of it, so the real call appends once: the training step and eval equal
    autocast's (with the custom-Function fence off, as above), and the cache the model
    returns holds each layer's keys once."""
    model, ids = _bloom_with_cache(64, 2, 1000, low=5, length=16)
    amp = assert_same_as_autocast(model, (), {"input_ids": ids}, policy="off:custom_ops")
    with torch.no_grad():
        cache = amp.eval()(input_ids=ids).past_key_values
    assert [layer.get_seq_length() for layer in cache.layers] == [16, 16]


def test_huggingface_bloom_first_called_in_eval_plans_its_attention_on_its_own_cache(caplog):
    """BLOOM first called in eval under ``no_grad`` (a sanity check before training), with
    its default ``use_cache=True``: its attention is traced with the cache's ``update`` as a
    call, whose autocast behaviour the plan observes by running it. That run appended to
    the cache the graph's own run then read, so ``baddbmm`` met 14 keys against 7, and the
    attention fell back to a plan for FP32 inputs with a warning that its numbers differ
    from autocast's. Each observation now runs on its own copy of the cache: the attention
    is planned as autocast runs it, with no fallback, and eval, then a training step, equal
    autocast's (the custom-Function fence off, as above)."""
    model, ids = _bloom_with_cache(32, 4, 96, low=3, length=7)
    ref, amp = _with_rewrite(model.eval(), "compute=bf16,target=cpu,off:custom_ops")
    with torch.no_grad(), caplog.at_level("WARNING"):
        got = amp(input_ids=ids)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = ref(input_ids=ids)
    assert not [r for r in caplog.records if "planned for FP32 inputs" in r.getMessage()]
    line = fxamp.plan_of(amp).nodes["transformer.h.0/self_attention/baddbmm"]
    assert (line.dtype, line.rule) == (torch.bfloat16, "autocast")
    assert torch.equal(got.logits, want.logits)
    assert [layer.get_seq_length() for layer in got.past_key_values.layers] == [7, 7]
    ref.train(), amp.train()
    with torch.autocast("cpu", torch.bfloat16):
        ref(input_ids=ids, labels=ids).loss.backward()
    amp(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), amp.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.slow
def test_huggingface_t5_new_lengths_in_shared_regions_and_eager_blocks_plan_anew():
    """T5 in place with the one line, first called in eval with an encoder of 7 tokens and
    a decoder of 4, then generating. Two refusals of a new length reached the user:
    the encoder's and the decoder's final ``T5LayerNorm`` (glue regions, identical, so one
    plan is shared) got the encoder's graph, exported with the sequence fixed at 7, for the
    decoder's 4; and a decoder block, run eagerly with its exported children, raised its
    child's fixed 4 when ``generate`` fed one token. A shared graph is now bound only
    where it takes the call's sizes. A child that refuses a size runs as autocast runs it,
    and its block is planned anew on its next call; here that call's KV cache holds the
    bf16 cross-attention keys of the calls before, which planning's FP32 run cannot take,
    so the block keeps its graph, its children under autocast on other sizes, as
    ``graphs_of`` says. The logits and the generated tokens equal autocast's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=96, d_model=32, d_ff=64, num_layers=1, num_heads=4,
                                d_kv=8, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ref, amp = _with_rewrite(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(3, 96, (2, 7), generator=g), torch.randint(3, 96, (2, 4),
                                                                          generator=g)
    with torch.no_grad():
        got = amp(input_ids=ids, labels=labels).logits
        tokens = amp.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        with torch.autocast("cpu", torch.bfloat16):
            want = ref(input_ids=ids, labels=labels).logits
            want_tokens = ref.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert torch.equal(tokens, want_tokens)
    made = fxamp.graphs_of(amp.get_submodule("decoder.block.0"))[""]
    assert len(made) == 2 and "its parts run under torch.autocast on other sizes" in made[1]


def test_huggingface_moe_layer_new_length_after_its_cache_was_appended_to():
    """A FlexOlmo decoder layer runs eagerly (its attention appends to HF's KV cache, which
    training passes too, ``use_cache=True`` by default) with its sparse MoE block exported,
    the sequence fixed at the first call's 7. A training step of 9 tokens: the attention
    has appended its keys when the MoE block refuses 9. Re-running the layer for a new plan
    appended them twice (the planning run failed, 18 keys against 9) and, where it did
    not fail, gave gradients unlike autocast's. The refusing child now runs as autocast
    runs it, the layer's code runs once, and the layer is planned anew on its next call,
    from that call's own arguments: the eval output and two training steps of new lengths
    equal autocast's, loss and every gradient."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FlexOlmoConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.FlexOlmoForCausalLM(cfg).eval()
    ref, amp = _with_rewrite(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 7), generator=g)
    with torch.no_grad():
        got = amp(input_ids=ids).logits
        with torch.autocast("cpu", torch.bfloat16):
            want = ref(input_ids=ids).logits
    assert torch.equal(got, want)
    ref.train(), amp.train()
    for size in ((2, 9), (3, 6)):
        ids = torch.randint(3, 96, size, generator=g)
        with torch.autocast("cpu", torch.bfloat16):
            want_loss = ref(input_ids=ids, labels=ids).loss
        loss = amp(input_ids=ids, labels=ids).loss
        want_loss.backward(), loss.backward()
        assert torch.equal(loss, want_loss)
        for (name, p), q in zip(ref.named_parameters(), amp.parameters()):
            assert torch.equal(p.grad, q.grad), name
        ref.zero_grad(), amp.zero_grad()
    made = fxamp.graphs_of(amp.get_submodule("model.layers.0"))[""]
    assert len(made) == 2 and "symbolic" in made[1], made


def test_huggingface_gpt_neox_japanese_layer_fx_cannot_compile_takes_another_front_end():
    """GPT-NeoX-Japanese's layer takes ``**kwargs`` and HF's ``position_embeddings`` tuple.
    torch.fx, tracing the tuple as its items, writes a forward that binds ``**kwargs`` and
    the items' defaults in one assignment, which Python cannot compile: the SyntaxError
    reached the user from the first call. fxamp now takes it as fx's failure, and the next
    front end plans the layer: the training step and eval equal autocast's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoXJapaneseConfig(vocab_size=128, hidden_size=32,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GPTNeoXJapaneseForCausalLM(cfg)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_same_as_autocast(model, (), {"input_ids": ids, "labels": ids})
