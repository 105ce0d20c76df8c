"""The train/eval alignment of ``frontends/modes.py`` alone, on real graph pairs: two
torch.fx traces and two torch.export exports of tiny models in train and eval mode."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxamp.frontends.common import training_flags
from fxamp.frontends.modes import (align, follow_mode, module_flag, reads_training,
                                   root_flag)


class FunctionalDrop(nn.Module):
    """Reads ``self.training`` as an argument: the two graphs differ by a bool."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, self.training)


class Branch(nn.Module):
    """Runs other ops in train mode: the two graphs cannot be aligned."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return x * 2
        return x.relu()


class Net(nn.Module):
    def __init__(self, custom: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.block = custom

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.bn(self.lin(x)))


def _fx_pair(model: nn.Module) -> tuple[fx.Graph, fx.Graph]:
    graphs = {}
    for mode in (True, False):
        with training_flags(model, mode):
            graphs[mode] = fx.Tracer().trace(model)
    return graphs[True], graphs[False]


def _export_pair(model: nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, fx.GraphModule]:
    gms = {}
    for mode in (True, False):
        with training_flags(model, mode):
            gms[mode] = torch.export.export(model, (x,), strict=False).module()
    return gms[True], gms[False]


def test_reads_training_one_meaning() -> None:
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert not reads_training(plain)  # no torch.nn class here reads the flag
    dropping = nn.Sequential(nn.Linear(4, 4), nn.Dropout())
    assert reads_training(dropping)  # Dropout's code reads it
    # a front end that keeps torch.nn modules as calls (fx) does not trace Dropout's code
    assert not reads_training(dropping, lambda m: not type(m).__module__.startswith("torch.nn"))
    # a class of this file: its whole source file is searched (helper functions included)
    assert reads_training(nn.Sequential(Branch()), lambda m: not isinstance(m, nn.Sequential))


def test_fx_pair_bool_follows_the_module_flag_of_the_kept_eval_graph() -> None:
    torch.manual_seed(0)
    model = Net(FunctionalDrop()).eval()
    train, eval_ = _fx_pair(model)
    aligned = align(train, eval_, (model, model))
    assert aligned is not None
    assert [(c.train.target, c.train_value) for c in aligned.changes] == [(F.dropout, True)]
    assert not aligned.counts and not aligned.alias  # (BatchNorm stays a call in fx)
    assert follow_mode(eval_, aligned, keep_train=False, flag_of=module_flag)
    gm = fx.GraphModule(model, eval_)
    assert "block.training" in gm.code
    x = torch.randn(16, 8)
    torch.testing.assert_close(gm(x), model(x))  # eval: no dropout
    gm.block.train()  # the module's own flag, as on the model
    out = gm(x)
    assert (out == 0).float().mean() > 0.2
    gm.block.eval()
    torch.testing.assert_close(gm(x), model(x))


def test_fx_pair_with_a_branch_on_training_does_not_align() -> None:
    model = Net(Branch())
    train, eval_ = _fx_pair(model)
    assert align(train, eval_, (model, model)) is None


def test_export_pair_dropout_and_batch_norm_follow_the_root_flag() -> None:
    torch.manual_seed(0)
    model = Net(nn.Dropout(0.5)).train()
    x = torch.randn(16, 8)
    train, other = _export_pair(model, x)
    aligned = align(train.graph, other.graph, (train, other))
    assert aligned is not None
    assert aligned.changes  # dropout's / batch norm's train flags
    assert [str(n.args[0].target) for n in aligned.counts] == ["bn.num_batches_tracked"]
    # the eval graph lacks the batch count: it cannot be the one kept
    assert not follow_mode(other.graph, aligned, keep_train=False, flag_of=root_flag)
    assert follow_mode(train.graph, aligned, keep_train=True, flag_of=root_flag)
    train.graph.lint()
    train.recompile()
    count = int(model.bn.num_batches_tracked)
    train.training = True  # (an exported module refuses train(): the flag itself)
    a, b = train(x), train(x)
    assert not torch.equal(a, b)  # dropout active
    assert int(model.bn.num_batches_tracked) == count + 2
    train.training = False
    model.eval()
    torch.testing.assert_close(train(x), model(x))
    torch.testing.assert_close(train(x), train(x))
    assert int(model.bn.num_batches_tracked) == count + 2  # eval counts no batches


def test_export_pair_with_a_branch_on_training_does_not_align() -> None:
    model = Net(Branch())
    train, other = _export_pair(model, torch.randn(4, 8))
    assert align(train.graph, other.graph, (train, other)) is None


class Scale(nn.Module):
    """A tensor constant made in forward (fx stores it on the root under a new name in
    each trace): the same value in both modes, or not."""

    def __init__(self, follows_mode: bool) -> None:
        super().__init__()
        self.follows_mode = follows_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = 2.0 if (self.training or not self.follows_mode) else 3.0
        return x * torch.tensor(value)


def test_fx_tensor_constants_match_by_value_not_by_name() -> None:
    for follows_mode in (False, True):
        model = Net(Scale(follows_mode))
        train, eval_ = _fx_pair(model)
        constants = [str(n.target) for g in (train, eval_) for n in g.nodes
                     if n.op == "get_attr" and "constant" in str(n.target)]
        assert len(set(constants)) == 2  # numbered apart by the two traces
        aligned = align(train, eval_, (model, model))
        assert (aligned is None) == follows_mode


def test_reads_training_looks_at_code_not_comments_or_docstrings() -> None:
    from fxamp.frontends.modes import _names_training

    assert _names_training("def f(self):\n    return self.training\n")
    assert _names_training("F.dropout(x, 0.1, training=flag)\n")
    assert _names_training("getattr(self, 'training')\n")
    assert not _names_training('"""Weights from a new training recipe."""\n# training\n')
    assert not _names_training("is_training = True\n")
