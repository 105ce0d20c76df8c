"""The policy weights=stored: each weight at rest in the dtype its nodes compute
in, for inference; outputs equal autocast's, loads convert, training is refused."""
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.errors import PolicyError, StoredWeightsError

BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = [z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v)]
        att = ((q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    """A small decoder: embedding, two blocks, final norm, a head (tied to the embedding
    when ``tied``)."""

    def __init__(self, vocab: int = 100, d: int = 32, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(seed))


def _model(seed: int = 0, tied: bool = False) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(tied=tied).eval()


def _stored(model: nn.Module, frontend: str = "fx", target: str = "cpu") -> nn.Module:
    return fxamp.amp_rewrite(model, (_ids(),),
                             fxamp.RewriteConfig.make(dtype=BF16, target=target, frontend=frontend,
                                                      partition="flat",
                                                      policy="weights=stored"), inplace=True)


def _autocast(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return model(ids)


def _weight_casts(model: nn.Module) -> list:
    """The nodes of every graph part that cast a Parameter."""
    found = []
    for part in fxamp.rewritten(model).modules():
        if not isinstance(part, fx.GraphModule):
            continue
        for node in part.graph.nodes:
            if node.op == "call_method" and node.target == "to" and \
                    node.args[0].op == "get_attr":
                owner, _, name = str(node.args[0].target).rpartition(".")
                value = getattr(part.get_submodule(owner) if owner else part, name)
                if isinstance(value, nn.Parameter):
                    found.append(node.name)
    return found


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("tied", [False, True])
def test_stored_outputs_equal_autocast_s_in_place(frontend, tied):
    ref = _model(tied=tied)
    model = _stored(copy.deepcopy(ref), frontend)
    for seed in (0, 1):
        with torch.no_grad():
            got = model(_ids(seed))
        want = _autocast(ref, _ids(seed))
        assert torch.equal(got, want.float())


def test_stored_is_refused_for_a_returned_module_and_the_model_is_left_fp32():
    model = _model()
    with pytest.raises(PolicyError, match="inplace=True"):
        fxamp.amp_rewrite(model, (_ids(),),
                          fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                   policy="weights=stored"))
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_weights_are_stored_in_the_dtype_of_the_nodes_that_read_them(frontend):
    model = _stored(_model(), frontend, target="cuda")  # (CUDA autocast: layer_norm FP32)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["blocks.0.qkv.weight"] == BF16 and dtypes["blocks.1.fc2.bias"] == BF16
    assert dtypes["head.weight"] == BF16
    assert dtypes["blocks.0.ln1.weight"] == torch.float32 and dtypes["ln.bias"] == torch.float32
    assert dtypes["emb.weight"] == torch.float32  # (an embedding follows its FP32 weight)
    assert list(model.buffers()) == []  # (no copy: no weight is read in both dtypes)
    assert fxamp.plan_of(model).header["stored"] == "17 weights in low precision"
    assert list(model.state_dict()) == list(_model().state_dict())


def test_a_tied_weight_read_in_both_dtypes_stays_fp32_with_one_low_copy():
    model = _stored(_model(tied=True))
    assert model.emb.weight is model.head.weight and model.emb.weight.dtype == torch.float32
    (name, copy_), = model.named_buffers()
    assert copy_.dtype == BF16 and torch.equal(copy_, model.emb.weight.to(BF16))
    assert "emb.weight (bf16)" in fxamp.plan_of(model).header["stored_copies"]
    assert name not in model.state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_no_weight_is_cast_in_the_graph(tied):
    cast = fxamp.amp_rewrite(_model(tied=tied), (_ids(),),
                             fxamp.RewriteConfig.make(dtype=BF16, target="cpu", partition="flat"),
                             inplace=True)
    assert _weight_casts(cast)  # (weights=cast casts them on every call)
    assert _weight_casts(_stored(_model(tied=tied))) == []


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_loading_fp32_weights_gives_a_fresh_stored_rewrite_s_outputs(assign, tied):
    model = _stored(_model(0, tied))
    new = _model(1, tied)
    model.load_state_dict(new.state_dict(), assign=assign)
    fresh = _stored(copy.deepcopy(new))
    assert {n: p.dtype for n, p in model.state_dict().items()} == \
        {n: p.dtype for n, p in fresh.state_dict().items()}
    with torch.no_grad():
        assert torch.equal(model(_ids(3)), fresh(_ids(3)))
    assert torch.equal(model(_ids(3)).detach(), _autocast(new, _ids(3)).float())


def test_loading_a_stored_model_s_low_precision_state_dict():
    model = _stored(_model(0))
    other = _stored(_model(1))
    state = other.state_dict()
    assert state["blocks.0.fc1.weight"].dtype == BF16 and state["ln.weight"].dtype == torch.float32
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model(_ids(2)), other(_ids(2)))


def test_a_backward_through_a_stored_model_is_refused():
    model = _stored(_model())
    out = model(_ids())  # (a forward with grad in eval mode is fine)
    with pytest.raises(StoredWeightsError, match="weights=cast"):
        out.sum().backward()


def test_a_forward_with_grad_in_train_mode_is_refused_and_without_grad_runs():
    model = _stored(_model()).train()
    with pytest.raises(StoredWeightsError, match="weights=stored"):
        model(_ids())
    with torch.no_grad():
        assert torch.equal(model(_ids()), _autocast(_model(), _ids()).float())


def test_a_deepcopy_of_a_stored_model_loads_into_its_own_weights_and_copy():
    model = _stored(_model(0, tied=True))
    twin = copy.deepcopy(model)
    new = _model(1, tied=True)
    twin.load_state_dict(new.state_dict())
    with torch.no_grad():
        assert torch.equal(twin(_ids(4)), _autocast(new, _ids(4)).float())
        assert torch.equal(model(_ids(4)), _autocast(_model(0, tied=True), _ids(4)).float())


@pytest.mark.parametrize("tied", [False, True])
def test_blocks_planned_on_their_first_call_store_their_weights(tied):
    ref = _model(tied=tied)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model,
                      config=fxamp.RewriteConfig.make(dtype=BF16, target="cpu",
                                                      policy="weights=stored"), inplace=True)
    with torch.no_grad():
        for seed in (0, 1):
            assert torch.equal(model(_ids(seed)).float(), _autocast(ref, _ids(seed)).float())
    for block in model.blocks:  # (the second shares the first's graph: stored alike)
        assert block.fc1.weight.dtype == BF16 and block.ln1.weight.dtype == torch.float32
    # (the glue is planned too: its head's weight is stored in bf16, unless the embedding,
    # which reads it in FP32, ties it)
    assert model.head.weight.dtype == (torch.float32 if tied else BF16)
    new = _model(1, tied=tied)
    model.load_state_dict(new.state_dict())
    with torch.no_grad():
        assert torch.equal(model(_ids(2)).float(), _autocast(new, _ids(2)).float())


@pytest.mark.parametrize("timing", ["example", "first call", "blocks"])
def test_float_after_the_rewrite_is_planned_and_stored_again(timing):
    """In block mode (planned on the first call, or ``partition="blocks"``) too: the glue's
    graph, planned again on its own change (the head's copy turned FP32), left the blocks'
    checks blind to theirs, and the next call fed FP32 weights to their BF16 graphs."""
    if timing == "example":
        model = _stored(_model(0, tied=True))
    else:
        model = fxamp.amp_rewrite(
            _model(0, tied=True), (_ids(),) if timing == "blocks" else None,
            fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend="fx",
                                     policy="weights=stored", partition=(
                                         "blocks" if timing == "blocks" else "auto")),
            inplace=True)
    with torch.no_grad():
        before = model(_ids())
    model.float()  # (the copy buffer too: every weight FP32, its values the rounded ones)
    with torch.no_grad():
        assert torch.equal(model(_ids()), before)
    assert model.blocks[0].fc1.weight.dtype == BF16
    if timing == "blocks":  # (the head, a region of its own: its weight, tied to the
        assert model.head.weight is model.emb.weight  # embedding's, kept, cast per call)
        assert model.head.weight.dtype == torch.float32
    else:
        assert model.head.weight_fxamp_bf16.dtype == BF16


class Optional_(nn.Module):
    """A forward with an optional argument: each call structure gets its own graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ln, self.out = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor = None) -> torch.Tensor:
        h = self.fc(x)
        if bias is not None:
            h = h + bias
        return self.out(self.ln(h))


@pytest.mark.parametrize("example", [True, False])
def test_a_new_call_structure_is_planned_on_the_stored_weights(example):
    torch.manual_seed(0)
    ref = Optional_().eval()
    model = copy.deepcopy(ref)
    x, bias = torch.randn(2, 16), torch.randn(16)
    fxamp.amp_rewrite(model, (x,) if example else None,
                      fxamp.RewriteConfig.make(dtype=BF16, target="cuda", policy="weights=stored"),
                      inplace=True)
    with torch.no_grad():
        first = model(x)
        weight = model.fc.weight
        second = model(x, bias)  # (planned on this call, on the stored weights)
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x), ref(x, bias)
    assert torch.equal(first, want[0].float()) and torch.equal(second, want[1].float())
    assert model.fc.weight is weight and weight.dtype == BF16
    assert model.ln.weight.dtype == torch.float32


@pytest.mark.slow
def test_gpt2_greedy_generate_in_place_gives_autocast_s_tokens(tmp_path):
    import transformers
    from safetensors.torch import load_file
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    model = copy.deepcopy(ref)
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    fxamp.amp_rewrite(model, (ids,),
                      fxamp.RewriteConfig.make(dtype=BF16, target="cpu", policy="weights=stored",
                                               partition="flat"),
                      inplace=True)
    assert model.transformer.h[0].attn.c_attn.weight.dtype == BF16
    assert model.transformer.wte.weight.dtype == torch.float32  # (tied to lm_head: a copy)
    assert "transformer.wte.weight" in fxamp.plan_of(model).header["stored_copies"]
    assert model.state_dict()["transformer.h.1.mlp.c_fc.weight"].dtype == BF16
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
        with torch.autocast("cpu", dtype=BF16):
            want = ref.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
    assert got.shape == (1, 11) and torch.equal(got, want)
    model.save_pretrained(tmp_path)  # (the stored dtypes; from_pretrained converts)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["transformer.h.0.attn.c_attn.weight"].dtype == BF16
    assert saved["transformer.h.0.ln_1.weight"].dtype == torch.float32
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.transformer.h[0].attn.c_attn.weight,
                       model.transformer.h[0].attn.c_attn.weight.float())
