"""``fxamp.diff`` / ``fxamp diff`` of two block-mode plans (rewriter/blocks.py): each block's
lines are compared relative to the block (its own lines, or those of the block whose plan it
shares), and a change made alike in several blocks is one entry naming them
(``model.layers.{0..2}/linear_6 ... [all 3 blocks]``); a change in one block is that block's
line, as before. Flat plans diff as before (tests/test_cli.py, tests/test_plan*.py)."""
from __future__ import annotations

from typing import Dict

import pytest
import torch

import fxamp
from fxamp.cli import main
from fxamp.plan import _spelled
from _block_nets import Net

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
PLAIN, EVERY, ONE = ("compute=bf16", "compute=bf16,fp32:mlp.down_proj",
                     "compute=bf16,fp32:model.layers.1.mlp.*")


def _llama_plan(config: str) -> fxamp.Plan:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    fxamp.amp_rewrite(model, config=config, inplace=True)
    model(input_ids=IDS)
    return fxamp.plan_of(model)


@pytest.fixture(scope="module")
def plans() -> Dict[str, fxamp.Plan]:
    return {config: _llama_plan(config) for config in (PLAIN, EVERY, ONE)}


def _changes(text: str) -> list:
    return [line for line in text.splitlines() if line[:2] in ("~ ", "+ ", "- ")]


def test_an_override_of_every_block_is_one_entry_naming_the_blocks(plans):
    text = fxamp.diff(plans[PLAIN], plans[EVERY])
    changes = _changes(text)
    assert len(changes) == 1, text
    line = changes[0]
    assert line.startswith("~ model.layers.{0..2}/") and "bf16 -> fp32" in line
    assert "policy override fp32:mlp.down_proj" in line and line.endswith("[all 3 blocks]")
    assert text.splitlines()[-1] == "3 nodes changed precision: 3 BF16\u2192FP32"
    assert "nested:" not in text  # (which blocks list their own lines: bookkeeping)
    table = fxamp.diff(plans[PLAIN], plans[EVERY], fmt="markdown")
    assert "| ~ | `model.layers.{0..2}/" in table and "` [all 3 blocks] |" in table


def test_an_override_of_one_block_is_reported_for_that_block_only(plans):
    text = fxamp.diff(plans[PLAIN], plans[ONE])
    changes = _changes(text)
    # (only layer 1's MLP ops: not its other lines, newly listed under its own path)
    mlp = [n for n, p in plans[ONE].nodes.items() if n.startswith("model.layers.1/")
           and p.module.startswith("model.layers.1.mlp") and p.op != "get_attr"]
    assert changes and len(changes) == len(mlp), text
    assert all(line.startswith("~ model.layers.1/") and "{" not in line and "blocks]" not in line
               for line in changes)
    assert all("bf16 -> fp32" in line and "fp32:mlp.*" in line for line in changes)
    assert "added" not in text.splitlines()[-1]
    assert text.splitlines()[-1].startswith(f"{len(mlp)} nodes changed precision")


def test_a_change_in_some_blocks_lists_them(plans):
    text = fxamp.diff(plans[EVERY], plans[ONE])
    grouped = [line for line in _changes(text) if "{" in line]
    assert len(grouped) == 1, text
    assert grouped[0].startswith("~ model.layers.{0,2}/") and "fp32 -> bf16" in grouped[0]
    assert grouped[0].endswith("[2 of 3 blocks]")
    assert fxamp.diff(plans[ONE], plans[ONE]) == ""


def test_the_cli_diffs_plan_files_alike(plans, tmp_path, capsys):
    old, new = tmp_path / "old.plan", tmp_path / "new.plan"
    plans[PLAIN].save(str(old))
    plans[EVERY].save(str(new))
    assert fxamp.Plan.load(str(new)) == plans[EVERY]
    capsys.readouterr()
    assert main(["diff", str(old), str(new)]) == 1
    out = capsys.readouterr().out
    assert out == fxamp.diff(plans[PLAIN], plans[EVERY])
    assert "model.layers.{0..2}/" in out and "[all 3 blocks]" in out
    assert main(["diff", str(old), str(old)]) == 0
    assert capsys.readouterr().out == ""
    assert main(["diff", str(old), str(new), "--format", "markdown"]) == 1
    assert "[all 3 blocks]" in capsys.readouterr().out


def _net_plan(config: str) -> fxamp.Plan:
    torch.manual_seed(0)
    model = Net(blocks=4)
    fxamp.amp_rewrite(model, config=config, inplace=True)
    model(torch.randn(4, 8))
    return fxamp.plan_of(model)


def test_a_hand_written_model_groups_two_of_four_blocks():
    """fc2 of blocks 1 and 3 in FP32: their FP32 residual flows on (the add of blocks 1 to 3,
    the input of blocks 2 and 3), each change one entry naming its blocks."""
    before = _net_plan("compute=bf16")
    after = _net_plan("compute=bf16,fp32:blocks.1.fc2,fp32:blocks.3.fc2")
    changes = _changes(fxamp.diff(before, after))
    assert changes[0].startswith("~ blocks.{1,3}/fc2  nn.Linear  bf16 -> fp32  (autocast -> "
                                 "user: policy override fp32:fc2)")
    assert changes[0].endswith("[2 of 4 blocks]")
    assert any(line.startswith("~ blocks.{1..3}/add ") and line.endswith("[3 of 4 blocks]")
               for line in changes), changes
    every = fxamp.diff(before, _net_plan("compute=bf16,fp32:fc2"))
    assert _changes(every)[0].startswith("~ blocks.{0..3}/fc2 ")
    assert _changes(every)[0].endswith("[all 4 blocks]")
    assert "BF16\u2192FP32" in every.splitlines()[-1]
    assert "added" not in every.splitlines()[-1]


def test_block_paths_are_spelled_in_runs():
    layers = [f"model.layers.{i}" for i in range(32)]
    assert _spelled("model.layers", layers) == "model.layers.{0..31}"
    assert _spelled("model.layers", ["model.layers.0", "model.layers.2"]) == "model.layers.{0,2}"
    picked = [f"h.{i}" for i in (0, 1, 2, 3, 7, 9, 10)]
    assert _spelled("h", picked) == "h.{0..3,7,9,10}"
    assert _spelled("", ["0", "1", "2"]) == "{0..2}"
    assert _spelled("enc", ["enc.a", "enc.b"]) == "enc.{a,b}"
