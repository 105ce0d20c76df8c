"""The per-call checks of a rewritten graph cost no binding and no pytree once a call of the
same form and values was seen, and still refuse what they refused: a call key remembered
with the Python scalars the graph fixed and the item types of its lists
(``fxamp/frontends/calls.py``, ``fxamp/program.py``), the shape check reading its inputs
straight from the call along a flat input spec and the plain-inputs hook giving a plain call
as it is (``fxamp/frontends/aten_inputs.py``), and a copied Program keeping both hooks. In
block mode a Hugging Face decoder layer (Python scalars and a tuple of tensors as
arguments) binds nothing once warm, and a changed scalar is still refused and planned."""
from __future__ import annotations

import collections
import copy
import inspect

import pytest
import torch
import torch.nn as nn
import transformers

import fxamp
from fxamp.errors import CallStructureError, InputShapeError

BF16 = torch.bfloat16
X = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture
def binds(monkeypatch) -> list:
    """Each ``inspect.Signature.bind`` call from now on, by the file of its caller."""
    seen: list = []
    real = inspect.Signature.bind

    def bind(self, *args, **kwargs):
        seen.append(inspect.currentframe().f_back.f_code.co_filename)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(inspect.Signature, "bind", bind)
    return seen


def _export(model: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
    return fxamp.amp_rewrite(model, args,
                             fxamp.RewriteConfig.make(example_kwargs=kwargs, dtype=BF16,
                                                      target="cpu", frontend="export"))


def _autocast(ref, *args, **kwargs):
    with torch.autocast("cpu", dtype=BF16):
        return ref(*args, **kwargs)


class Flagged(nn.Module):
    """A Python bool the graph fixes and a tuple of tensors, as a decoder layer takes
    ``use_cache`` and ``position_embeddings``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pair: tuple = None, double: bool = False
                ) -> torch.Tensor:
        y = self.lin(x) + pair[0] * pair[1]
        return y * 2 if double else y


PAIR = (torch.rand(2, 3, 4), torch.rand(2, 3, 4))


def test_a_repeated_call_with_the_examples_scalar_and_list_binds_nothing(binds):
    torch.manual_seed(0)
    ref = Flagged()
    gm = _export(copy.deepcopy(ref), (X,), {"pair": PAIR, "double": False})
    first = gm(X, pair=PAIR, double=False)  # (admitted once: its key and values remembered)
    binds.clear()
    for _ in range(3):
        assert torch.equal(gm(X, pair=PAIR, double=False), first)
    assert torch.equal(first, _autocast(ref, X, pair=PAIR, double=False))
    assert binds == []
    other = (torch.rand(2, 3, 4), torch.rand(2, 3, 4))  # (other tensors: the same reading)
    gm(X, pair=other, double=False)
    assert binds == []


def test_another_scalar_or_list_is_refused_after_the_first_is_remembered():
    torch.manual_seed(0)
    gm = _export(Flagged(), (X,), {"pair": PAIR, "double": False})
    for _ in range(2):
        gm(X, pair=PAIR, double=False)
    with pytest.raises(CallStructureError, match="'double' = True") as err:
        gm(X, pair=PAIR, double=True)
    assert err.value.scalar == "double" and err.value.program is gm
    with pytest.raises(CallStructureError, match="'pair' a tuple of 3") as err:
        gm(X, pair=(*PAIR, PAIR[0]), double=False)
    assert err.value.program is gm
    with pytest.raises(CallStructureError, match="'pair' a tuple of 2 \\(tensor, none\\)"):
        gm(X, pair=(PAIR[0], None), double=False)
    with pytest.raises(CallStructureError, match="'double' = 1"):
        gm(X, pair=PAIR, double=1)  # (1 == True: the key's type tells them apart)
    assert torch.equal(gm(X, pair=PAIR, double=False), gm(X, pair=PAIR, double=False))


def test_the_shape_check_reads_a_flat_spec_and_refuses_as_before():
    torch.manual_seed(0)
    gm = _export(Flagged(), (X,), {"pair": PAIR, "double": False})
    check = next(iter(gm._forward_pre_hooks.values()))
    gm(X, pair=PAIR, double=False)
    assert check.reads[1] is not None  # (the spec is flat: read without pytree)
    bad = (PAIR[0], torch.rand(2, 3, 5))
    with pytest.raises(InputShapeError, match="dimension 2 of input 'pair\\[1\\]' fixed at 4"
                       ) as err:
        gm(X, pair=bad, double=False)
    assert err.value.program is gm and not getattr(err.value, "bound", False)
    with pytest.raises(InputShapeError, match="takes input 'x' with 3 dimensions"):
        gm(X[0], pair=PAIR, double=False)


def test_the_plain_inputs_hook_still_makes_an_ordered_dict_plain():
    from fxamp.frontends.aten_inputs import plain_inputs_hook

    inner = collections.OrderedDict(a=X)
    assert plain_inputs_hook(None, (X, [X, None], {"k": 1}), {"m": (X,)}) is None
    args, kwargs = plain_inputs_hook(None, (X,), {"m": [inner]})
    assert type(kwargs["m"][0]) is dict and kwargs["m"][0]["a"] is X


def test_a_copied_program_keeps_the_shape_check_and_its_message():
    torch.manual_seed(0)
    gm = _export(Flagged(), (X,), {"pair": PAIR, "double": False})
    other = copy.deepcopy(gm)
    assert len(other._forward_pre_hooks) == len(gm._forward_pre_hooks) == 2
    assert torch.equal(other(X, pair=PAIR, double=False), gm(X, pair=PAIR, double=False))
    wide = torch.rand(2, 3, 5)
    with pytest.raises(InputShapeError, match="fixed at 4") as err:
        other(wide, pair=PAIR, double=False)
    assert err.value.program is other


def _llama(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def test_block_mode_llama_binds_nothing_once_warm(binds):
    ref = _llama()
    model = fxamp.amp_rewrite(copy.deepcopy(ref), config="compute=bf16", inplace=True)
    for _ in range(2):
        model(input_ids=IDS, labels=IDS).loss.backward()
    binds.clear()
    ref(input_ids=IDS, labels=IDS)
    fp32 = list(binds)  # (what the model's own code binds, if anything)
    binds.clear()
    loss = model(input_ids=IDS, labels=IDS).loss
    assert binds == fp32
    assert not any("fxamp" in f for f in binds)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(input_ids=IDS, labels=IDS).loss
    assert torch.equal(loss, want)


def test_block_mode_llama_refuses_and_plans_a_changed_num_items_in_batch():
    """Hugging Face hands num_items_in_batch (a Python int) to each decoder layer: a layer's
    graph fixes it, so another value is refused by the graph (``.scalar``, ``.program``:
    what in-place planning takes as a miss) and planned, however often the first was seen."""
    ref = _llama()
    model = fxamp.amp_rewrite(copy.deepcopy(ref), config="compute=bf16", inplace=True)
    calls: list = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: calls.append((a, dict(k))), with_kwargs=True)
    for count in (20, 20, 20, 31, 20, 31):
        loss = model(input_ids=IDS, labels=IDS, num_items_in_batch=count).loss
        with torch.autocast("cpu", dtype=BF16):
            want = ref(input_ids=IDS, labels=IDS, num_items_in_batch=count).loss
        assert torch.equal(loss, want), count
    args, kwargs = calls[0]
    assert kwargs["num_items_in_batch"] == 20
    layer = fxamp.amp_rewrite(copy.deepcopy(ref.model.layers[0]), config="compute=bf16",
                              inplace=True)
    for _ in range(3):
        layer(*args, **kwargs)
    gm = layer.__dict__["_fxamp_rewritten"]
    assert "num_items_in_batch" in gm.__dict__["fxamp_result"].calls.scalars
    with pytest.raises(CallStructureError, match="'num_items_in_batch' = 31") as err:
        gm(*args, **{**kwargs, "num_items_in_batch": 31})
    assert err.value.scalar == "num_items_in_batch" and err.value.program is gm
    assert layer(*args, **{**kwargs, "num_items_in_batch": 31}) is not None  # (planned)
