"""What a rewritten graph's generated code runs on each call (``program.code_graph``):

- each common aten op of an exported graph through its Python binding
  (``fxamp._torch.fast_call``): each binding, given the arguments the graph holds,
  dispatches the same aten ops and gives the same values bit for bit, with and without
  grad; the graph itself keeps the ops;
- no torch.export input guard where fxamp's own checks cover each of its conditions, and
  the guard whole where one is not covered;
- an activation cast for several consumers made once without grad and per consumer in a
  training step, as autocast casts, with autocast's gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxamp
from fxamp._torch import INPUT_GUARD, _fast_table, fast_call
from fxamp.errors import InputShapeError
from fxamp.perf import count_casts

aten = torch.ops.aten


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


#: for each op of the table, the arguments an exported graph gives it (trailing defaults
#: included, as export writes them)
CASES = {
    aten.linear.default: lambda: ((_t(2, 3, 8), _t(4, 8), _t(4)), {}),
    aten.silu.default: lambda: ((_t(2, 8),), {}),
    aten.gelu.default: lambda: ((_t(2, 8),), {"approximate": "tanh"}),
    aten.scaled_dot_product_attention.default: lambda: (
        (_t(1, 2, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8), None, 0.0, True),
        {"scale": 0.5}),
    aten.embedding.default: lambda: ((_t(10, 4), torch.tensor([[1, 2, 9]])), {}),
    aten.layer_norm.default: lambda: ((_t(2, 3, 8), [8], _t(8), _t(8), 1e-05, True), {}),
    aten.mul.Tensor: lambda: ((_t(2, 8), 0.5), {}),
    aten.add.Tensor: lambda: ((_t(2, 8), _t(8)), {"alpha": 2}),
    aten.sub.Tensor: lambda: ((_t(2, 8), 1), {}),
    aten.div.Tensor: lambda: ((_t(2, 8), _t(2, 1)), {}),
    aten.pow.Tensor_Scalar: lambda: ((_t(2, 8), 2), {}),
    aten.neg.default: lambda: ((_t(2, 8),), {}),
    aten.rsqrt.default: lambda: ((_t(2, 8).abs() + 0.1,), {}),
    aten.sqrt.default: lambda: ((_t(2, 8).abs(),), {}),
    aten.exp.default: lambda: ((_t(2, 8),), {}),
    aten.tanh.default: lambda: ((_t(2, 8),), {}),
    aten.sigmoid.default: lambda: ((_t(2, 8),), {}),
    aten.relu.default: lambda: ((_t(2, 8),), {}),
    aten.mean.dim: lambda: ((_t(2, 3, 8), [-1], True), {}),
    aten.sum.dim_IntList: lambda: ((_t(2, 3, 8), [1], False), {}),
    aten.cat.default: lambda: (([_t(2, 3), _t(2, 5)], -1), {}),
    aten.transpose.int: lambda: ((_t(2, 3, 8), 1, 2), {}),
    aten.unsqueeze.default: lambda: ((_t(2, 8), 1), {}),
    aten.reshape.default: lambda: ((_t(2, 3, 8), [2, -1]), {}),
    aten.permute.default: lambda: ((_t(2, 3, 8), [2, 0, 1]), {}),
    aten.matmul.default: lambda: ((_t(2, 3, 8), _t(8, 4)), {}),
    aten.bmm.default: lambda: ((_t(2, 3, 8), _t(2, 8, 4)), {}),
    aten.softmax.int: lambda: ((_t(2, 8), -1), {}),
    aten.dropout.default: lambda: ((_t(2, 8), 0.0, False), {}),
    aten.conv2d.default: lambda: ((_t(1, 2, 5, 5), _t(3, 2, 3, 3), _t(3), [1, 1], [1, 1],
                                   [1, 1], 1), {}),
    aten.view.default: lambda: ((_t(2, 3, 8), [6, 8]), {}),
    aten.to.dtype: lambda: ((_t(2, 8), torch.bfloat16, False, False, None), {}),
    aten.contiguous.default: lambda: ((_t(8, 2).t(),), {}),
    aten.expand.default: lambda: ((_t(1, 8), [3, 8]), {}),
}


class _Ops(TorchDispatchMode):
    """The aten ops dispatched, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _run(target, args, kwargs, fast: bool):
    if not fast:
        return target(*args, **kwargs)
    call, args = fast_call(target, args)
    if isinstance(call, str):
        return getattr(args[0], call)(*args[1:], **kwargs)
    return call(*args, **kwargs)


def test_every_op_of_the_table_has_a_case():
    assert set(_fast_table()) == set(CASES)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("target", list(CASES), ids=str)
def test_binding_dispatches_the_same_ops_with_the_same_values(target, grad):
    args, kwargs = CASES[target]()
    if grad:
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor)
                     and a.is_floating_point() else a for a in args)
    results = []
    for fast in (False, True):
        with torch.set_grad_enabled(grad), _Ops() as mode:
            out = _run(target, args, kwargs, fast)
        results.append((mode.ops, out))
    (ops, out), (fast_ops, fast_out) = results
    assert fast_ops == ops
    assert out.dtype == fast_out.dtype and torch.equal(out, fast_out)
    if grad:
        assert type(out.grad_fn) is type(fast_out.grad_fn)


def test_to_with_a_memory_format_keeps_the_op_overload():
    assert fast_call(aten.to.dtype, (None, torch.bfloat16, False, False,
                                     torch.channels_last)) is None
    assert fast_call(aten.to.dtype, (None, torch.bfloat16, False, False, None)) == (
        "to", (None, torch.bfloat16))


def test_other_targets_are_called_as_they_are():
    assert fast_call(aten.slice.Tensor, (None, 0, 0, 1)) is None
    assert fast_call(torch.add, (1, 2)) is None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.nn.functional.gelu(self.fc(h)).transpose(0, 1).transpose(0, 1)


def test_an_exported_blocks_code_calls_bindings_and_its_graph_keeps_the_ops():
    model = _Block()
    x = torch.randn(4, 3, 16)
    out = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(
        dtype=torch.bfloat16, target="cpu", frontend="export"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert torch.equal(out(x), ref.float())
    graph_targets = {n.target for n in out.graph.nodes if n.op == "call_function"}
    assert aten.linear.default in graph_targets
    assert "torch.ops.aten.linear" not in out.code
    assert "torch._C._nn.linear(" in out.code
    assert "torch.ops.aten.transpose" not in out.code


def _export(model: nn.Module, *args, **make):
    return fxamp.amp_rewrite(model, args, fxamp.RewriteConfig.make(
        dtype=torch.bfloat16, target="cpu", frontend="export", **make))


def test_a_guard_fxamp_checks_already_is_left_out_and_a_new_size_still_refused():
    out = _export(_Block(), torch.randn(4, 3, 16), dynamic_shapes=None)
    assert not hasattr(out, INPUT_GUARD)
    assert "guards" not in out.code
    with pytest.raises(InputShapeError, match="dimension 1 of input 'x' fixed at 3"):
        out(torch.randn(4, 5, 16))


class _Flagged(nn.Module):
    """A block taking a Python bool the export fixes (``use_cache``, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        return self.fc(x) * 2 if flag else self.fc(x)


def test_a_guard_on_a_python_value_the_call_structure_compares_is_left_out():
    out = _export(_Flagged(), torch.randn(2, 8), True)
    assert not hasattr(out, INPUT_GUARD)
    with pytest.raises(fxamp.FxampError, match="flag"):
        out(torch.randn(2, 8), False)


class _Even(nn.Module):
    """A block whose code needs an even size of a dynamic dimension: a guard condition
    no fxamp check covers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).reshape(x.shape[0] // 2, 2, 8).sum(1)


def test_a_guard_with_a_condition_no_check_covers_stays_whole():
    from torch.export import Dim

    out = _export(_Even(), torch.randn(6, 8), dynamic_shapes={"x": {0: Dim.AUTO}})
    assert hasattr(out, INPUT_GUARD)
    assert out(torch.randn(4, 8)).shape == (2, 8)
    with pytest.raises(InputShapeError):
        out(torch.randn(5, 8))


class _Qkv(nn.Module):
    """An activation cast for three consumers (q, k, v) and one more consumer in FP32."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x * 2)
        return (self.q(h) * self.k(h) + self.v(h)).float().sum(-1)


def _casts_to_bf16(fn, backward=None) -> int:
    counted = count_casts(fn, backward)
    return sum(n for (_, src, dst, phase), n in counted.by_kind.items()
               if phase == "forward" and src == "f32" and dst == "bf16")


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_cast_for_several_consumers_is_made_once_without_grad_and_per_consumer_in_training(
        frontend):
    model = _Qkv()
    x = torch.randn(2, 5, 16)
    out = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(
        dtype=torch.bfloat16, target="cpu", frontend=frontend))
    assert "fxamp_runtime_shared_cast(" in out.code

    def autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    with torch.no_grad():
        weights = 6  # (three weights and biases: each cast once a call, as autocast caches)
        assert _casts_to_bf16(lambda: out(x)) == weights + 1
    trained = _casts_to_bf16(lambda: out(x), lambda o: o.sum().backward())
    assert trained == _casts_to_bf16(autocast, lambda o: o.sum().backward()) == weights + 3
    grads = []
    for fn in (lambda: out(x), autocast):
        model.zero_grad()
        fn().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_pickled_rewrite_loads_the_graph_it_pickled_and_trains_like_autocast():
    import io
    from collections import Counter

    model = _Qkv()
    x = torch.randn(2, 5, 16)
    out = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(
        dtype=torch.bfloat16, target="cpu", frontend="fx"))
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)

    def calls(gm):
        return Counter(str(n.target) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_method"))

    # (fxamp's run-time calls were traced through on load: the fan-out vanished, and the
    # input dtype check with it)
    assert calls(back) == calls(out)
    assert "fxamp_runtime_shared_cast(" in back.code

    def autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    grads = []
    for fn in (lambda: back(x), autocast):
        for p in (*back.parameters(), *model.parameters()):
            p.grad = None
        fn().sum().backward()
        grads.append([p.grad.clone() for p in (back if fn is not autocast else model)
                      .parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Nested(nn.Module):
    """A block taking a tuple and a dict of tensors, positionally and by keyword (as HF's
    decoder layers take ``position_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pair: tuple, extra: dict = None,
                scale: torch.Tensor = None) -> torch.Tensor:
        h = self.fc(x) * pair[0] + pair[1]
        return h + extra["b"] - extra["a"] * scale


@pytest.mark.parametrize("by", ["keyword", "position"])
def test_an_exported_graphs_nested_inputs_are_bound_by_indexing_with_its_values(by):
    """The generated code reads each leaf of a tuple or dict argument by indexing it, as
    ``tree_flatten_spec`` does (no call of it), and computes what the graph computes."""
    from torch.fx.graph import _PyTreeCodeGen

    model = _Nested()
    x, pair = _t(2, 8), (_t(2, 1), _t(8))
    extra = {"a": _t(2, 8), "b": _t(1, 8)}
    scale = torch.tensor(0.5)
    args = (x, pair, extra, scale) if by == "position" else (x, pair)
    kwargs = {} if by == "position" else {"extra": extra, "scale": scale}
    out = fxamp.amp_rewrite(model, args, fxamp.RewriteConfig.make(
        dtype=torch.bfloat16, target="cpu", frontend="export", example_kwargs=kwargs))
    assert type(out.graph._codegen) is _PyTreeCodeGen  # (the graph keeps its own)
    assert "tree_flatten_spec" not in out.code
    assert "pair[1]" in out.code and "extra['b']" in out.code
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(*args, **kwargs)
    assert torch.equal(out(*args, **kwargs), ref.float())
