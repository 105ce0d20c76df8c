"""Buffer updates in forward are part of the rewritten graph on every front end: after N
calls the buffers, outputs and gradients equal N calls of the model under autocast."""
import copy

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import TraceError, UnsupportedModelError

BF16 = dict(target="cpu", dtype=torch.bfloat16)
FRONTENDS = ["fx", "export"]


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))


class Counter(_Base):
    """``+=`` on a buffer, then the buffer used."""

    def forward(self, x):
        self.steps += 1
        return self.a(x) * self.steps


class InPlaceEma(_Base):
    """An EMA updated in place from a constant and the activations."""

    def forward(self, x):
        y = self.a(x)
        self.ema.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y * self.ema


class AssignedEma(_Base):
    """An EMA assigned a new tensor, then used."""

    def forward(self, x):
        y = self.a(x)
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        return y * self.ema


class AssignedAfterUse(_Base):
    """The old value saved for backward before the buffer is assigned."""

    def forward(self, x):
        y = self.a(x)
        z = y * self.ema
        self.ema = self.ema * 0.9 + 0.1 * y.detach().mean(0)
        return z + self.ema


class IntCounter(nn.Module):
    """An integer counter bumped with no tensor input involved (as batch norm's)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return self.a(x)


MODELS = [Counter, InPlaceEma, AssignedEma, AssignedAfterUse, IntCounter]


def _calls(model, n, autocast):
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    outs = []
    for _ in range(n):
        if autocast:
            with torch.autocast("cpu", torch.bfloat16):
                out = model(x)
        else:
            out = model(x)
        out.float().sum().backward()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_buffer_updates_repeat_on_every_call_as_under_autocast(cls, frontend):
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    before = {n: b.clone() for n, b in model.named_buffers()}
    gm = fxamp.amp_rewrite(model, (torch.randn(3, 4),),
                           fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    for name, value in model.named_buffers():  # the rewrite did not update them
        assert torch.equal(value, before[name]), name
    got, want = _calls(gm, 3, False), _calls(ref, 3, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), name
    assert torch.equal(model.a.weight.grad, ref.a.weight.grad)


def test_fx_node_names_stay_symbolic_traces_when_buffers_are_only_read():
    class Reads(_Base):
        def forward(self, x):
            return self.a(x) * torch.exp(torch.tanh(self.ema))

    model = Reads()
    gm = fxamp.amp_rewrite(model, (torch.randn(3, 4),),
                           fxamp.RewriteConfig.make(frontend="fx", **BF16))
    names = [n.name for n in torch.fx.symbolic_trace(copy.deepcopy(model)).graph.nodes
             if n.op != "output"]
    assert list(fxamp.plan_of(gm).nodes) == names


def test_timm_batchnormact_counts_batches_like_autocast():
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct2d(8), nn.Conv2d(8, 4, 3)).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 12, 12)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(frontend="fx", **BF16))
    assert model[1].num_batches_tracked.item() == 0
    for _ in range(2):
        gm(x)
        with torch.autocast("cpu", torch.bfloat16):
            ref(x)
    assert model[1].num_batches_tracked.item() == 2
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), name


def test_one_buffer_update_in_many_modules_of_a_class_is_one_retrace(monkeypatch):
    """Every BatchNormAct2d counts its batches in Python: the fx trace is taken again once
    for the class (reading all their counters as nodes), not once per module, and every
    counter still counts like autocast's."""
    from timm.layers import BatchNormAct2d

    from fxamp.frontends.fx import FxampTracer

    traces = []
    real = FxampTracer.trace

    def counted(self, root, concrete_args=None):
        traces.append(1)
        return real(self, root, concrete_args)

    monkeypatch.setattr(FxampTracer, "trace", counted)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Conv2d(4, 4, 3, padding=1),
                                                            BatchNormAct2d(4))]).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 8, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(frontend="fx", **BF16))
    assert len(traces) <= 3, len(traces)  # (first trace, again for the class, eval mode)
    gm(x)
    with torch.autocast("cpu", torch.bfloat16):
        ref(x)
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), name


def test_fx_refuses_a_buffer_value_read_by_python_naming_the_line():
    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct2d(8, momentum=None))
    with pytest.raises(TraceError, match=r"num_batches_tracked") as err:
        fxamp.amp_rewrite(model, (torch.randn(2, 3, 8, 8),),
                          fxamp.RewriteConfig.make(frontend="fx", **BF16))
    assert "norm_act.py" in str(err.value)
    assert model[1].num_batches_tracked.item() == 0  # refused before it changed


def test_a_buffer_set_to_none_in_forward_is_refused_by_name():
    class Drops(_Base):
        def forward(self, x):
            self.ema = None
            return self.a(x)

    with pytest.raises(TraceError, match=r"sets buffer 'ema' to None"):
        fxamp.amp_rewrite(Drops(), (torch.randn(3, 4),),
                          fxamp.RewriteConfig.make(frontend="fx", **BF16))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_buffer_assigned_another_shape_is_refused_naming_the_line(frontend):
    class Grows(_Base):
        def forward(self, x):
            y = self.a(x)
            self.ema = y.detach().mean()  # shape () into a buffer of shape (4,)
            return y

    with pytest.raises(UnsupportedModelError, match=r"shape \(4,\).*shape \(\)") as err:
        fxamp.amp_rewrite(Grows(), (torch.randn(3, 4),),
                          fxamp.RewriteConfig.make(frontend=frontend, **BF16))
    assert "test_buffer_updates.py" in str(err.value)
    assert str(err.value).count("what to do") == 1


@pytest.mark.slow
def test_timm_cumulative_batchnorm_runs_under_auto_and_counts_calls():
    """momentum=None reads the counter in Python: fx and export refuse the norm, auto runs
    it eagerly under autocast with the other children rewritten (their inputs cast to the
    dtypes they were planned for)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=4)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
    x = torch.randn(2, 3, 32, 32)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    counts = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
    assert all(c.item() == 0 for c in counts)
    for _ in range(2):
        assert torch.isfinite(gm(x)).all()
    assert all(c.item() == 2 for c in counts)
