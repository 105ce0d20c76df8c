"""Block sharing (rewriter/blocks.py ``share_key``): a block computes with another block's plan
only when everything its trace could have read is equal on it. Two blocks of one class that
differ in a setting held in any way (a function attribute, an ``_underscore`` float, a dict, a
dataclass, an Enum member, a plain tensor, a shared config read at ``self.layer_idx``, a
submodule's class or instance ``forward``, a hook on a child) are planned each on its own, and
compute bit for bit like ``torch.autocast``; identical blocks still share one plan."""
from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from _block_nets import tiny_llama, traces

log = logging.getLogger(__name__)

_ACTS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu, "sigmoid": torch.sigmoid}


class Act(enum.Enum):
    """An activation chosen per block by an Enum member."""

    RELU = "relu"
    TANH = "tanh"
    GELU = "gelu"


@dataclasses.dataclass
class Conf:
    """A per-block config held as a dataclass."""

    act: str
    scale: float


class Kinds:
    """One config object shared by all blocks (as HF's ``PretrainedConfig`` is)."""

    def __init__(self, kinds: List[str]) -> None:
        self.kinds = kinds


class Helper(nn.Module):
    """A stateless module a block holds outside its tree, one per block (as ``kernels``'
    ``use_kernelized_func`` does in HF's Llama attention)."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ACTS[self.act](x)


class Block(nn.Module):
    """A block whose forward reads one setting, held in the way ``how`` names.

    Args:
        how: how the setting is held (``function``, ``underscore``, ``dict``, ``dataclass``,
            ``enum``, ``tensor``, ``partial``, ``helper``).
        value: the setting (an activation's name, or a scale for ``underscore``/``tensor``).
    """

    def __init__(self, how: str, value: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.how = how
        if how == "function":
            self.fn = _ACTS[value]
        elif how == "underscore":
            self._scale = value
        elif how == "dict":
            self.opts = {"act": value}
        elif how == "dataclass":
            self.conf = Conf(act=value, scale=1.5)
        elif how == "enum":
            self.act = Act(value)
        elif how == "tensor":
            self.scale = torch.tensor(value)
        elif how == "partial":  # (one per block, as HF's GELUTanh holds)
            self.fn = functools.partial(F.gelu, approximate=value)
        elif how == "helper":
            self._funcs = {"act": Helper(value)}
        else:
            raise ValueError(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.how == "function":
            return self.fn(h)
        if self.how == "underscore":
            return h * self._scale
        if self.how == "dict":
            return _ACTS[self.opts["act"]](h)
        if self.how == "dataclass":
            return _ACTS[self.conf.act](h) * self.conf.scale
        if self.how == "enum":
            return _ACTS[self.act.value](h)
        if self.how == "partial":
            return self.fn(h)
        if self.how == "helper":
            return self._funcs["act"](h)
        return h * self.scale


class IndexedBlock(nn.Module):
    """A block whose forward reads a config shared by all blocks at its own ``layer_idx``."""

    def __init__(self, cfg: Kinds, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ACTS[self.cfg.kinds[self.layer_idx]](self.fc(x))


class CachedBlock(nn.Module):
    """A block that holds a ``layer_idx`` only to index a cache it is not given here."""

    def __init__(self, cfg: Kinds, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, cache: Optional[Any] = None) -> torch.Tensor:
        h = self.fc(x)
        if cache is not None:
            h = cache.update(h, self.layer_idx)
        return torch.relu(h)


class ActBlock(nn.Module):
    """A block whose activation is a child module (its class may differ from block to block)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    """A model whose forward loops over its blocks (after a stem, so that each block gets
    its input in autocast's dtype: the blocks' calls are alike)."""

    def __init__(self, blocks: List[nn.Module]) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net(blocks: Callable[[], List[nn.Module]]) -> Net:
    torch.manual_seed(0)
    return Net(blocks())


def _check(model: nn.Module, calls: int = 1) -> int:
    """Rewrite ``model`` in block mode and compare ``calls`` calls with autocast's, bit for bit;
    returns how many blocks were traced."""
    ref = copy.deepcopy(model)
    with traces({type(b).__name__ for b in model.blocks}) as counted:
        fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
        for step in range(calls):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = ref(x)
            got = model(x)
            diff = (got.float() - want.float()).abs().max().item()
            assert torch.equal(got.float(), want.float()), (step, diff)
    assert fxamp.plan_of(model).header["frontend"] == "blocks"
    return counted.count


#: (how the setting is held, the value in each block)
_DIFFER = [("function", ["relu", "tanh"]), ("underscore", [0.5, 2.0, 3.0]),
           ("dict", ["relu", "gelu"]), ("dataclass", ["relu", "tanh", "gelu"]),
           ("enum", ["relu", "tanh"]), ("tensor", [2.0, 3.0]), ("partial", ["none", "tanh"]),
           ("helper", ["relu", "tanh"])]


@pytest.mark.parametrize("how,values", _DIFFER, ids=[h for h, _ in _DIFFER])
def test_blocks_whose_setting_differs_are_planned_apart(how, values):
    assert _check(_net(lambda: [Block(how, v) for v in values])) == len(values)


@pytest.mark.parametrize("how,values", _DIFFER, ids=[h for h, _ in _DIFFER])
def test_blocks_whose_settings_are_equal_share_one_plan(how, values):
    """Equal settings, each block's own objects (dicts, dataclasses, tensors, partials,
    helper modules; the functions and Enum members are the same ones): one trace for three
    blocks."""
    assert _check(_net(lambda: [Block(how, values[0]) for _ in range(3)])) == 1


def test_a_shared_config_read_at_the_layer_index_is_planned_per_block():
    """``self.cfg.kinds[self.layer_idx]``: the config is one object, so only the index tells
    the blocks apart; the forward reads it, so it counts."""
    cfg = Kinds(["relu", "tanh", "relu"])
    assert _check(_net(lambda: [IndexedBlock(cfg, i) for i in range(3)])) == 3


def test_a_layer_index_read_only_for_a_cache_does_not_keep_blocks_apart():
    cfg = Kinds(["relu", "tanh"])
    assert _check(_net(lambda: [CachedBlock(cfg, i) for i in range(3)])) == 1


def test_a_childs_class_or_instance_forward_that_differs_keeps_blocks_apart():
    assert _check(_net(lambda: [ActBlock(nn.Tanh()), ActBlock(nn.Sigmoid())])) == 2

    def make() -> List[nn.Module]:
        blocks = [ActBlock(nn.Identity()) for _ in range(2)]
        blocks[1].act.forward = torch.tanh  # (an instance's own forward)
        return blocks

    assert _check(_net(make)) == 2


def test_a_hook_on_a_blocks_child_registered_before_the_rewrite_fires_once_per_call():
    """The hook on ``blocks[1].fc`` doubles its output and counts: block 1 is planned on its
    own (its child kept as a call), so the hook runs once per call and the numbers are
    autocast's; blocks 0 and 2 (no hook) share one plan."""
    model = _net(lambda: [Block("function", "relu") for _ in range(3)])
    calls: List[nn.Module] = []

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        calls.append(module)
        return out * 2

    model.blocks[1].fc.register_forward_hook(hook)
    fc = model.blocks[1].fc
    assert _check(model, calls=2) == 2  # (autocast's run on a copy holding the same hook)
    # (once per call on the model's own module; the planning of block 1 runs it once more,
    # on the planner's copy of the block: annotate's autocast run of a kept call)
    assert sum(m is fc for m in calls) == 2


def test_the_same_hook_on_every_blocks_child_still_shares():
    model = _net(lambda: [Block("function", "relu") for _ in range(3)])
    calls: List[nn.Module] = []

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        calls.append(module)

    for block in model.blocks:
        block.fc.register_forward_hook(hook)
    fcs = [block.fc for block in model.blocks]
    assert _check(model) == 1
    assert [m for m in calls if any(m is fc for fc in fcs)] == fcs


def _hf_models() -> Dict[str, Callable[[], nn.Module]]:
    transformers = pytest.importorskip("transformers")

    def gpt2() -> nn.Module:
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=3, n_head=2,
                                      n_positions=64, bos_token_id=0, eos_token_id=0,
                                      use_cache=False)
        return transformers.GPT2LMHeadModel(cfg)

    def bert() -> nn.Module:
        cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=64)
        return transformers.BertModel(cfg)

    return {"llama": lambda: tiny_llama(3), "gpt2": gpt2, "bert": bert}


_LAYERS = {"llama": "model.layers", "gpt2": "transformer.h", "bert": "encoder.layer"}


@pytest.mark.slow  # (over 5 s: transformers' import, the first trace)
@pytest.mark.parametrize("name", list(_LAYERS))
def test_hf_layers_without_a_cache_still_share_one_plan(name):
    """HF layers hold ``layer_idx`` only to index a KV cache (and a shared config): without
    a cache they share one plan, one trace for three layers."""
    torch.manual_seed(0)
    model = _hf_models()[name]().eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    layers = {"LlamaDecoderLayer", "GPT2Block", "BertLayer", "BertEmbeddings"}
    with traces(layers) as counted, torch.no_grad():
        fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
        got = model(input_ids=ids)[0]
    log.info("%s: rewrite and first call %.2f s", name, time.perf_counter() - start)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(input_ids=ids)[0]
    assert torch.equal(got.float(), want.float())
    assert counted.count == (2 if name == "bert" else 1)  # (BERT's embeddings: a block too)
    plan = fxamp.plan_of(model)
    assert plan.header["frontend"] == "blocks"
    layers = _LAYERS[name]
    for i in (1, 2):
        assert f"the same plan as {layers}.0" in plan.nodes[f"{layers}.{i}"].reason


@pytest.mark.slow  # (transformers' import, the eager recording runs)
def test_hf_layers_with_a_kv_cache_share_one_eager_plan_each_reading_its_own_layer_index():
    """With HF's default ``use_cache=True`` every decoder layer takes the eager front end
    (the cache is an object its code appends to). Identical layers share one eager plan,
    made once: each copy runs its own layer's Python forward, so ``layer_idx`` (read live,
    to index the cache) is its own. Training, and a decode step with the cache, equal
    autocast's; before, each layer was recorded and planned on its own (32 layers: 4.6x
    torch.export's time)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    ref = transformers.LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with traces({"LlamaDecoderLayer"}) as counted:
        fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
        out = model(input_ids=ids, labels=ids)
    assert counted.count == 1  # (one layer planned; the other three share its plan)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(input_ids=ids, labels=ids)
    assert torch.equal(out.loss, want.loss)
    out.loss.backward(), want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    plan = fxamp.plan_of(model)
    for i in (1, 2, 3):
        assert "the same plan as model.layers.0" in plan.nodes[f"model.layers.{i}"].reason
    model.eval(), ref.eval()
    with torch.no_grad():
        prompt = model(input_ids=ids[:, :8], use_cache=True)
        step = model(input_ids=ids[:, 8:9], past_key_values=prompt.past_key_values)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_prompt = ref(input_ids=ids[:, :8], use_cache=True)
            ref_step = ref(input_ids=ids[:, 8:9], past_key_values=ref_prompt.past_key_values)
    assert torch.equal(step.logits, ref_step.logits)
    cache = step.past_key_values
    assert cache.get_seq_length() == 9 and len(cache.layers) == 4  # (each layer its own)
    for k in range(4):
        assert cache.layers[k].keys.shape[-2] == 9


class _Scaled(nn.Module):
    """A block whose weights and a Python scale differ per instance."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + 1


def test_a_graphs_copy_for_another_block_shares_its_graph_and_code_and_reads_its_weights():
    """A plan's copy for an identical block (``frontends/copies.py``, ``bound_to``) holds
    the same graph and the same generated code (no new trace, no new compile: 12 ms a
    copy before, most of a 32-layer HF model's first call with a KV cache), and computes
    with the other block's weights: its output and gradients are the other block's own
    rewrite's, bit for bit, and the first graph's are unchanged."""
    from fxamp.frontends.copies import bound_to

    torch.manual_seed(0)
    a, b = _Scaled(1.0), _Scaled(1.0)
    x = torch.randn(4, 8)
    gm = fxamp.amp_rewrite(a, (x,), config="compute=bf16")
    before = gm(x)
    made = bound_to(gm, a, b)
    assert made.graph is gm.graph and type(made) is type(gm)
    assert made.fc is b.fc
    want = fxamp.amp_rewrite(copy.deepcopy(b), (x,), config="compute=bf16")
    got = made(x)
    assert torch.equal(got, want(x)) and not torch.equal(got, before)
    assert torch.equal(gm(x), before)
    got.float().sum().backward()
    assert b.fc.weight.grad is not None and a.fc.weight.grad is None

