"""Trainer resume is all or nothing, and the trainer refuses an optimizer that trains nothing.

A checkpoint that does not fit (another model, optimizer layout or kind, scaler, or not a
trainer checkpoint) raises CheckpointError and leaves every tensor of the model, the
optimizer and the scaler as it was.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.errors import CheckpointError, FxampError
from fxamp.train import Trainer


class MLP(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


BATCH = (torch.randn(8, 4, generator=torch.Generator().manual_seed(0)),
         torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(1)))


def rewrite(hidden=8, seed=0, dtype=torch.float16):
    torch.manual_seed(seed)
    model = MLP(hidden)
    return model, fxamp.amp_rewrite(model, (torch.zeros(2, 4),),
                                    fxamp.RewriteConfig.make(dtype=dtype, target="cpu"))


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def two_groups(model):
    return torch.optim.SGD([{"params": [model.fc1.weight]},
                            {"params": [model.fc1.bias, *model.fc2.parameters()]}],
                           lr=0.1, momentum=0.9)


def trained(hidden=8, seed=0, optimizer=adam, dtype=torch.float16):
    model, gm = rewrite(hidden, seed, dtype)
    trainer = Trainer(gm, optimizer(model))
    trainer.step(loss_fn, *BATCH)
    return model, trainer


def tensors(trainer):
    """Copies of every tensor the trainer would change on a resume, and its counters."""
    out = {f"model.{k}": v.clone() for k, v in trainer.gm.state_dict().items()}
    opt = trainer.optimizer.state_dict()
    for pid, entry in opt["state"].items():
        out.update({f"opt.{pid}.{k}": v.clone() for k, v in entry.items()
                    if isinstance(v, torch.Tensor)})
    out["opt.groups"] = copy.deepcopy(opt["param_groups"])
    out["scaler"] = copy.deepcopy(trainer.scaler.state_dict())
    out["counters"] = (trainer.steps, trainer.micro_steps, list(trainer.loss_history))
    return out


def assert_unchanged(before, trainer):
    after = tensors(trainer)
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key


def refused(trainer, state, *words):
    before = tensors(trainer)
    with pytest.raises(CheckpointError) as err:
        trainer.load_state_dict(state)
    assert_unchanged(before, trainer)
    text = str(err.value)
    assert "nothing was loaded" in text and "what to do" in text
    for word in words:
        assert word in text, text
    return text


def test_another_optimizer_layout_leaves_model_optimizer_and_scaler_untouched():
    _, source = trained()
    _, target = trained(seed=1, optimizer=two_groups)
    refused(target, source.state_dict(), "1 parameter groups", "SGD has 2")


def test_another_models_checkpoint_leaves_even_its_matching_tensors_untouched():
    _, source = trained(hidden=8)
    _, target = trained(hidden=16, seed=1)
    # fc2.bias has the same shape in both models: it must not be overwritten either
    refused(target, source.state_dict(), "fc1.weight: checkpoint (8, 4) float32, model (16, 4)")


def test_optimizer_state_of_other_shapes_is_refused_without_the_model():
    _, source = trained(hidden=8)
    _, target = trained(hidden=16, seed=1)
    refused(target, source.state_dict(include_model=False), "'exp_avg' is (8, 4)",
            "parameter is (16, 4)")


def test_another_optimizer_kind_is_refused():
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    _, source = trained(optimizer=sgd)
    _, target = trained(seed=1)
    refused(target, source.state_dict(), "another kind", "'momentum'", "'betas'")


def test_a_bf16_checkpoint_into_an_fp16_trainer_is_refused():
    _, source = trained(dtype=torch.bfloat16)
    _, target = trained(seed=1)
    refused(target, source.state_dict(), "GradScaler was disabled")


def test_a_plain_model_state_dict_says_what_a_trainer_checkpoint_holds():
    _, trainer = trained()
    text = refused(trainer, trainer.gm.state_dict(), "model's state_dict", "'optimizer'",
                   "Trainer.state_dict()", "trainer.gm.load_state_dict")
    assert "KeyError" not in text


def test_a_matching_checkpoint_still_loads_everything():
    _, source = trained()
    source.step(loss_fn, *BATCH)
    model, target = trained(seed=1)
    target.load_state_dict(source.state_dict())
    assert (target.steps, target.micro_steps) == (2, 2)
    for a, b in zip(source.gm.parameters(), model.parameters()):
        assert torch.equal(a, b)
    saved, loaded = source.optimizer.state_dict(), target.optimizer.state_dict()
    assert all(torch.equal(saved["state"][i]["exp_avg"], loaded["state"][i]["exp_avg"])
               for i in saved["state"])


def test_an_optimizer_over_another_copys_parameters_is_refused():
    model, gm = rewrite()
    other = copy.deepcopy(model)
    with pytest.raises(FxampError, match="none of the optimizer's 4 parameters"):
        Trainer(gm, torch.optim.SGD(other.parameters(), lr=0.1))
    mixed = torch.optim.SGD([*model.fc1.parameters(), *other.fc2.parameters()], lr=0.1)
    with pytest.raises(FxampError, match=r"fc2.weight \(3, 8\)"):
        Trainer(gm, mixed)


def test_an_optimizer_with_the_models_and_the_losss_parameters_is_accepted():
    model, gm = rewrite()
    temperature = nn.Parameter(torch.ones(()))
    Trainer(gm, torch.optim.SGD([*model.parameters(), temperature], lr=0.1))
    model.fc1.requires_grad_(False)  # a frozen part is simply not in the optimizer
    Trainer(gm, torch.optim.SGD(model.fc2.parameters(), lr=0.1))
