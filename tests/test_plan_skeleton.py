"""A block-mode model's plan before its first call (rewriter/blocks.py ``BlocksRoot.skeleton``):
``plan_of`` gives a skeleton, the header (``planned: no``) and one line per block, not planned
yet; after the first call the real plan. ``print(model)`` shows each block's state. What
needs a real plan (``fxamp.diff``, ``fxamp diff``, ``fxamp check``, ``result_of``) refuses a
skeleton by name; a model planned whole on its first call still raises ``NotPlannedError``.
The state note is no part of the share key: identical blocks still share one plan."""
from __future__ import annotations

import copy
import warnings
from typing import List

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.cli import main
from fxamp.errors import NotPlannedError
from fxamp.result import result_of
from _block_nets import Block, Net, copied, traces

BF16 = torch.bfloat16
NOT_YET = "not planned yet: planned on its first call"


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
PATHS = ["blocks.0", "blocks.1", "blocks.2"]


def _check_skeleton(plan: fxamp.Plan, model: nn.Module, paths: List[str]) -> None:
    """``plan`` is ``model``'s skeleton: one line per block (``paths`` among them; the
    modules the model plans on their own, as its BlocksRoot lists them), none planned."""
    assert not plan.planned
    assert plan.header["planned"] == "no"
    assert plan.header["frontend"] == "blocks"
    assert "compute=bf16" in plan.header["policy"] and plan.header["fxamp"] == fxamp.__version__
    assert list(plan.nodes) == model.__dict__["forward"].paths
    assert [name for name in plan.nodes if name in paths] == paths
    assert all(NOT_YET in line.reason and line.rule == "nested" and line.module == path
               for path, line in plan.nodes.items())
    again = fxamp.Plan.from_text(plan.to_text())
    assert again == plan and not again.planned


def test_a_hand_written_model_lists_its_blocks_then_plans_them_sharing_one_trace():
    model = _net()
    ref = copy.deepcopy(model)
    with traces({"Block"}) as counted:
        fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
        _check_skeleton(fxamp.plan_of(model), model, PATHS)
        assert fxamp.config_of(model).policy.compute == BF16
        assert str(model).count("fxamp: planned on its first call") >= 1
        assert all("fxamp: planned on its first call" in repr(b) for b in model.blocks)
        got = model(X)
    assert counted.count == 1  # (one trace, three blocks: the note is no part of the key)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(X)
    assert torch.equal(got.float(), want.float())
    plan = fxamp.plan_of(model)
    assert plan.planned and "planned" not in plan.header
    assert any(n.startswith("blocks.0/") for n in plan.nodes)
    assert "the same plan as blocks.0" in plan.nodes["blocks.2"].reason
    assert "fxamp: planned\n" in repr(model.blocks[0]) + "\n"
    assert "shares" not in repr(model.blocks[0])
    for block in model.blocks[1:]:
        assert "fxamp: planned (shares blocks.0's plan)" in repr(block)
    assert type(model.blocks[0]) is Block  # (the class is unchanged)


def test_a_tiny_llama_lists_its_decoder_layers_before_its_first_call():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with traces({"LlamaDecoderLayer"}) as counted:
        fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
        skeleton = fxamp.plan_of(model)
        _check_skeleton(skeleton, model, [f"model.layers.{i}" for i in range(3)])
        assert skeleton.nodes["model.layers.0"].op.endswith("LlamaDecoderLayer")
        shown = str(model)
        assert "LlamaDecoderLayer(\n        fxamp: planned on its first call" in shown
        model(input_ids=ids)
    assert counted.count == 1
    plan = fxamp.plan_of(model)
    assert plan.planned and any(n.startswith("model.layers.0/") for n in plan.nodes)
    assert "fxamp: planned (shares model.layers.0's plan)" in repr(model.model.layers[2])
    assert type(model.model.layers[0]) is transformers.models.llama.modeling_llama.LlamaDecoderLayer


def test_a_model_planned_whole_still_raises_not_planned():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    with pytest.raises(NotPlannedError, match="planned on its first call"):
        fxamp.plan_of(model)
    model(X)
    assert fxamp.plan_of(model).planned


def test_a_skeleton_is_refused_where_a_real_plan_is_needed(tmp_path, capsys):
    model = _net()
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    skeleton = fxamp.plan_of(model)
    with pytest.raises(NotPlannedError, match="fxamp.plan_of gives its skeleton"):
        result_of(model)
    with pytest.raises(NotPlannedError, match="the second plan is a skeleton"):
        fxamp.diff(fxamp.plan_of(_called()), skeleton)
    with pytest.raises(fxamp.FxampError, match="block mode"):
        fxamp.rewritten(model)
    path = tmp_path / "skeleton.plan"
    skeleton.save(str(path))
    real = tmp_path / "real.plan"
    fxamp.plan_of(_called()).save(str(real))
    capsys.readouterr()
    assert main(["diff", str(real), str(path)]) == 2
    err = capsys.readouterr().err
    assert f"fxamp diff: {path} is a skeleton" in err and "call the model once" in err
    assert main(["check", "fxamp.demo:small_cnn", "--plan", str(path)]) == 2
    assert "is a skeleton" in capsys.readouterr().err


def _called() -> Net:
    model = _net()
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    model(X)
    return model


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_before_the_first_call_has_its_own_skeleton_and_states(how):
    model = _net()
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    twin = copied(model, how)
    _check_skeleton(fxamp.plan_of(twin), twin, PATHS)
    twin(X)
    assert fxamp.plan_of(twin).planned
    assert not fxamp.plan_of(model).planned  # (the original is not called yet)
    assert "fxamp: planned on its first call" in repr(model.blocks[1])
    assert "fxamp: planned (shares blocks.0's plan)" in repr(twin.blocks[1])


def test_a_replaced_block_and_a_rewrite_with_inputs_take_the_note_off():
    model = _called()
    old = model.blocks[1]
    model.blocks[1] = Block()
    model(X)  # (the new block is planned on this call; the old one gets its forward back)
    assert "fxamp" not in repr(old)
    assert "fxamp: planned" in repr(model.blocks[1])
    fxamp.amp_rewrite(model, (X,), fxamp.RewriteConfig.make(policy="compute=bf16",
                                                            partition="flat"),
                      inplace=True)  # (undoes the blocks)
    assert all("fxamp" not in repr(block) for block in model.blocks)
    assert fxamp.plan_of(model).planned


def test_a_block_with_its_own_extra_repr_keeps_it():
    class Scaled(Block):
        def extra_repr(self) -> str:
            return "scale=2"

    model = Net()
    model.blocks = nn.ModuleList([Scaled() for _ in range(3)])
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    assert "scale=2\n  fxamp: planned on its first call" in repr(model.blocks[0])


def test_a_trainer_checkpoint_taken_before_the_first_step_loads_with_the_skeleton():
    """``fxamp.train.Trainer`` on a block-mode model reads the policy from its skeleton; a
    checkpoint taken before the first step (its plan: the skeleton) loads without comparing
    plans, and one taken after compares real plans (no warning when they are equal)."""
    from fxamp.train import Trainer

    model = _net()
    fxamp.amp_rewrite(model, config="compute=bf16,target=cpu", inplace=True)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = trainer.state_dict()
    assert not fxamp.Plan.from_text(state["plan"]).planned
    trainer.load_state_dict(state)  # (no NotPlannedError from comparing a skeleton)
    model(torch.randn(4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.load_state_dict(trainer.state_dict())
