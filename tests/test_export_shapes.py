"""The export front end's shapes: static but for the batch (and token-sequence) dimensions
or the user's ``dynamic_shapes=``; a clear InputShapeError on a fixed dimension; and how
many times torch.export.export runs per rewrite (counted by a passthrough to the real one)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import fxamp
from fxamp.errors import InputShapeError

BF16 = dict(dtype=torch.bfloat16, target="cpu", frontend="export")


class Pool(nn.Module):
    """Image-like input: a conv, a pool that keeps the spatial size out of the output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def test_one_export_for_a_model_without_mode_dependent_code(export_calls) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    gm = fxamp.amp_rewrite(model, (torch.randn(3, 8),), fxamp.RewriteConfig.make(**BF16))
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    assert len(export_calls) == 1


def test_dropout_model_still_follows_train_and_eval_with_two_exports(export_calls) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).eval()
    gm = fxamp.amp_rewrite(model, (torch.randn(3, 8),), fxamp.RewriteConfig.make(**BF16))
    assert len(export_calls) == 2  # the train graph (base) and the eval graph (static)
    x = torch.randn(5, 8)  # another batch size than the example's
    gm.eval()
    assert torch.equal(gm(x), gm(x))
    torch.testing.assert_close(gm(x), model(x), rtol=0.03, atol=0.03)
    gm.train()
    assert not torch.equal(gm(x), gm(x))  # dropout is on in train mode


def test_batch_is_dynamic_other_dims_are_fixed_with_a_clear_error() -> None:
    torch.manual_seed(0)
    model = Pool().eval()
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 3, 16, 16),), fxamp.RewriteConfig.make(**BF16))
    for batch in (1, 5):
        x = torch.randn(batch, 3, 16, 16)
        torch.testing.assert_close(gm(x), model(x), rtol=0.03, atol=0.03)
    with pytest.raises(InputShapeError) as info:
        gm(torch.randn(2, 3, 20, 16))
    message = str(info.value)
    assert "dimension 2 of input 'x' fixed at 16" in message
    assert "this call gives 20" in message
    assert "dynamic_shapes={'x': {0: Dim.AUTO, 2: Dim.AUTO}}" in message
    with pytest.raises(InputShapeError, match="4 dimensions"):
        gm(torch.randn(2, 3, 16))


def test_user_dynamic_shapes_are_honoured() -> None:
    torch.manual_seed(0)
    model = Pool().eval()
    shapes = {"x": {0: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO}}
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 3, 16, 16),),
                           fxamp.RewriteConfig.make(dynamic_shapes=shapes, **BF16))
    for size in ((3, 3, 20, 24), (1, 3, 9, 16)):
        x = torch.randn(*size)
        torch.testing.assert_close(gm(x), model(x), rtol=0.03, atol=0.03)
    # and a fully static request fixes the batch too
    static = fxamp.amp_rewrite(model, (torch.randn(2, 3, 16, 16),),
                               fxamp.RewriteConfig.make(dynamic_shapes={"x": None}, **BF16))
    with pytest.raises(InputShapeError, match="dimension 0 of input 'x' fixed at 2"):
        static(torch.randn(4, 3, 16, 16))


@pytest.mark.slow
def test_token_inputs_keep_batch_and_sequence_dynamic() -> None:
    """Hugging Face BERT (only the export front end takes it): token ids and the attention
    mask are integer inputs, so their batch and sequence dimensions stay symbolic."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (2, 8))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    gm = fxamp.amp_rewrite(model, (), fxamp.RewriteConfig.make(example_kwargs=kwargs, **BF16))
    for batch, seq in ((3, 12), (1, 5)):
        ids = torch.randint(0, 100, (batch, seq))
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        out = gm(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert out.shape == (batch, seq, 32)
        torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)


def test_batch_one_example_advice_is_an_example_of_batch_two_which_takes_batch_three() -> None:
    """torch.export fixes a dimension whose example size is 1 whatever ``dynamic_shapes``
    says: the advice is a batch of 2 or more, and following it makes the batch-3 call run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    gm = fxamp.amp_rewrite(model, (torch.randn(1, 8),), fxamp.RewriteConfig.make(**BF16))
    x = torch.randn(3, 8)
    with pytest.raises(InputShapeError) as info:
        gm(x)
    message = str(info.value)
    assert "dimension 0 of 'input' has size 2 or more" in message
    assert "Dim.AUTO" not in message  # (which changes nothing for a size-1 example)
    with pytest.raises(InputShapeError, match="fixed at 1"):  # what the old advice did
        fxamp.amp_rewrite(
            model, (torch.randn(1, 8),),
            fxamp.RewriteConfig.make(dynamic_shapes={"input": {0: Dim.AUTO}}, **BF16))(x)
    followed = fxamp.amp_rewrite(model, (torch.randn(2, 8),), fxamp.RewriteConfig.make(**BF16))
    torch.testing.assert_close(followed(x), model(x), rtol=0.03, atol=0.03)


class Bounded(nn.Module):
    """A sequence dimension the model's code bounds: a table of 6 positions sliced to it."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(6, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.pos[: ids.shape[1]] + ids[..., None].float())


def test_a_call_past_a_bound_export_derived_is_an_input_shape_error_naming_it() -> None:
    torch.manual_seed(0)
    model = Bounded().eval()
    ids = torch.randint(0, 5, (2, 4))
    gm = fxamp.amp_rewrite(model, (ids,), fxamp.RewriteConfig.make(**BF16))
    ok = torch.randint(0, 5, (3, 6))
    torch.testing.assert_close(gm(ok), model(ok), rtol=0.03, atol=0.03)
    with pytest.raises(InputShapeError) as info:  # was: AssertionError: Guard failed
        gm(torch.randint(0, 5, (2, 8)))
    message = str(info.value)
    assert "input 'ids' with dimension 1 of size at most 6" in message
    assert "this call gives 8" in message and "what to do" in message


@pytest.mark.slow
def test_bert_past_its_max_positions_is_an_input_shape_error_naming_input_ids() -> None:
    """Hugging Face BERT with 64 positions, in place, called with 80 tokens: fxamp's error
    naming the argument and the bound, not torch.export's bare guard."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, vocab_size=100,
                                 max_position_embeddings=64)).eval()
    fxamp.amp_rewrite(model, (torch.randint(0, 100, (2, 16)),), inplace=True,
                      config=fxamp.RewriteConfig.make(**BF16))
    assert model(torch.randint(0, 100, (3, 64))).last_hidden_state.shape == (3, 64, 32)
    with pytest.raises(InputShapeError) as info:
        model(torch.randint(0, 100, (2, 80)))
    message = str(info.value)
    assert "input 'input_ids' with dimension 1 of size at most 64" in message
    assert "this call gives 80" in message


class Pairs(nn.Module):
    """A batch the model's code needs even (rows taken two by two): a guard on a derived
    size, not a fixed size or a bound."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.reshape(x.shape[0] // 2, 16))


def test_any_other_failing_export_guard_is_an_input_shape_error_naming_the_input() -> None:
    torch.manual_seed(0)
    model = Pairs().eval()
    gm = fxamp.amp_rewrite(model, (torch.randn(4, 8),), fxamp.RewriteConfig.make(**BF16))
    x = torch.randn(6, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=0.03, atol=0.03)
    with pytest.raises(InputShapeError) as info:  # was: AssertionError: Guard failed: ...
        gm(torch.randn(5, 8))
    message = str(info.value)
    assert "the rewritten Pairs was exported for calls where `" in message
    assert "x.size()[0]" in message and "input 'x'" in message
    assert "what to do" in message
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under an outer autocast too
        with pytest.raises(InputShapeError):
            gm(torch.randn(5, 8))
        assert torch.is_autocast_enabled("cpu")  # (put back on)


class Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) + self.lin(b)


def test_two_dims_export_found_equal_called_unequal_name_both_inputs() -> None:
    torch.manual_seed(0)
    model = Sum().eval()
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 8), torch.randn(2, 8)),
                           fxamp.RewriteConfig.make(**BF16))
    a, b = torch.randn(5, 8), torch.randn(5, 8)
    torch.testing.assert_close(gm(a, b), model(a, b), rtol=0.03, atol=0.03)
    with pytest.raises(InputShapeError) as info:  # was: AssertionError: Guard failed
        gm(torch.randn(3, 8), torch.randn(4, 8))
    message = str(info.value)
    assert "dimension 0 of input 'b' equal to dimension 0 of input 'a'" in message
    assert "this call gives 4 and 3" in message
