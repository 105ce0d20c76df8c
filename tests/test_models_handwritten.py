"""Hand-written models through ``fxamp.amp_rewrite``, checked against real autocast.

Every model below is small and deterministic (fixed seeds). For each one and each of the
configurations ``cpu/bf16``, ``cpu/fp16`` and ``cuda/fp16`` the planned dtype of every node
must equal the dtype ``torch.autocast`` really gives it (CPU: real autocast; CUDA: the
AutocastCUDA kernels on fake CUDA tensors, see ``autocast_truth``). On CPU the rewritten
model's outputs must also equal what the original model gives under ``torch.autocast``.

Why the output comparison is exact (``rtol=atol=0``): under autocast a listed op casts its
floating inputs with ``Tensor.to`` and then runs the ordinary kernel; the rewritten graph
performs the very same ``.to`` casts explicitly and then calls the very same kernel on the
same shapes, and ops on no list run on the same input dtypes in both. Nothing is reassociated
or fused, so the results are bit-identical; any difference means a cast is missing, extra,
to the wrong dtype, or applied to a stale value.

"""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from autocast_truth import record_autocast_dtypes, run_autocast_cpu, autocast_rewrite
from fxamp.frontends.fx import trace as fxamp_trace
from fxamp.runtime import check_input_dtypes, fan_out
from fxamp.weight_cache import is_cast_node

CONFIGS = [("cpu", torch.bfloat16), ("cpu", torch.float16), ("cuda", torch.float16)]
CPU_CONFIGS = [c for c in CONFIGS if c[0] == "cpu"]


def _cfg_id(cfg: Tuple[str, torch.dtype]) -> str:
    return f"{cfg[0]}-{str(cfg[1]).replace('torch.', '')}"


def _seed(n: int = 0) -> None:
    torch.manual_seed(n)


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------
class LowerOps(nn.Module):
    """linear, matmul, bmm, conv2d, baddbmm, scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x, img):
        h = self.fc(x)                                   # (2, 4, 8)
        m = h @ self.w                                   # matmul with a get_attr weight
        b = torch.bmm(m, h.transpose(1, 2))              # (2, 4, 4)
        bb = torch.baddbmm(b, h, m.transpose(1, 2), alpha=0.5)
        q = h.unsqueeze(1)                               # (2, 1, 4, 8)
        a = F.scaled_dot_product_attention(q, q, q).squeeze(1)
        c = self.conv(img).flatten(1)                    # (2, 4*4*4)
        return torch.matmul(bb, a).flatten(1), c


class Einsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6) / 3)

    def forward(self, x):
        return torch.einsum("bi,ij->bj", x, self.w)


class Fp32Ops(nn.Module):
    """exp, log, pow, 1/x, rsqrt, layer_norm, group_norm, mse_loss, cross_entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x, target):
        h = self.fc(x)
        t = torch.tanh(h)
        e = torch.exp(t)
        lg = torch.log(e + 1.0)
        p = t.pow(2)
        r = 1 / (e + 1.0)
        rs = torch.rsqrt(p + 1.0)
        y = self.ln(e + lg + p + r + rs)
        g = self.gn(h)
        ce = F.cross_entropy(h, target)
        mse = F.mse_loss(y, g)
        fl = F.layer_norm(h, (8,))
        return y, g, fl, ce + mse


class Fp32OptOps(nn.Module):
    """softmax, log_softmax, sum, cumsum with and without an explicit dtype=."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return (torch.softmax(h, -1), F.softmax(h, dim=-1, dtype=torch.float32),
                torch.log_softmax(h, -1), h.log_softmax(-1, dtype=torch.float16),
                h.sum(-1, keepdim=True), torch.sum(h, -1, dtype=torch.float32),
                torch.cumsum(h, -1), h.cumsum(-1, dtype=torch.float16),
                h.softmax(-1, dtype=x.dtype))


class PromoteOps(nn.Module):
    """cat / stack / addcmul over a low-precision and an fp32 value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)  # low precision under autocast
        c = torch.cat([h, x], -1)
        s = torch.stack([x, h])
        a = torch.addcmul(x, h, x, value=0.5)
        a2 = torch.addcmul(h, h, h)  # all-low
        return c, s, a, a2


class FollowOps(nn.Module):
    """relu, gelu, add, mean, view: on no list, they follow their inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        g = self.act(h) + F.gelu(x)   # low + fp32 -> fp32 by ordinary promotion
        m = g.mean(-1, keepdim=True)
        v = (h + m).view(-1, 4, 2)
        return self.fc2(v.view(-1, 8)) + h * 2


class IntegerPaths(nn.Module):
    """embedding indices, boolean masks (masked_fill), argmax, integer arange."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 10)
        self.pos = nn.Embedding(6, 8)

    def forward(self, idx, x):
        e = self.emb(idx)                                    # (2, 6, 8) fp32
        pos = torch.arange(idx.shape[1], device=idx.device)  # int64
        h = self.fc(e + self.pos(pos) + x)                   # low
        mask = idx > 4                                       # bool
        h = h.masked_fill(mask.unsqueeze(-1), 0.0)
        nxt = h.argmax(-1)                                   # int64 from a low value
        again = self.emb(nxt % 10)                           # integer -> embedding
        fidx = (pos * 2).float()                             # int -> float via the model
        return h, again + fidx.unsqueeze(-1), nxt, mask


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        a, b = h.chunk(2, dim=-1)
        return (a, torch.softmax(b, -1)), x.argmax(-1)


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        h = self.fc(x)
        return {"logits": h, "probs": torch.softmax(h, -1), "norm": self.ln(h),
                "label": h.argmax(-1)}


class Buffers(nn.Module):
    """A float buffer used by a lower-list op and an fp32-list op, an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("proj", torch.randn(8, 8) / 3)
        self.register_buffer("ids", torch.arange(8))

    def forward(self, x):
        h = self.fc(x) * self.scale
        p = h @ self.proj                    # the float buffer is cast like a weight
        e = torch.exp(torch.tanh(self.scale))
        sel = p.index_select(-1, self.ids.flip(0))
        return sel + e


class TiedLinears(nn.Module):
    """Two Linears sharing one weight; an embedding tied to the output head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc2.weight = self.fc1.weight
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.relu(self.fc1(h))
        h = self.fc2(h)
        return self.head(h)


class ConvBN(nn.Module):
    """conv -> BatchNorm -> relu -> dropout -> linear (train-mode behaviour matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn0 = nn.BatchNorm2d(2)   # sees the fp32 input
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)    # sees the low-precision conv output
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(self.bn0(x))))
        return self.fc(self.drop(h).flatten(1))


class FunctionalDropout(nn.Module):
    """A custom forward that passes self.training to F.dropout (fx would bake the bool in)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = self.bn(self.fc(x))
        h = F.dropout(h, 0.5, self.training)
        return self.out(h)


class DtypeBranchRMS(torch.autograd.Function):
    """A 'fused' RMS norm whose forward picks eps from the input dtype."""

    @staticmethod
    def forward(ctx, x):
        eps = 1e-6 if x.dtype == torch.float32 else 1e-3
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(DtypeBranchRMS.apply(self.fc1(x)))


class MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return self.fc(out), weights


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _idx(*shape: int, high: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


#: name -> (model class, example inputs factory)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {
    "lower": (LowerOps, lambda: (_x(2, 4, 8), _x(2, 2, 4, 4, seed=3))),
    "einsum": (Einsum, lambda: (_x(4, 8),)),
    "fp32": (Fp32Ops, lambda: (_x(4, 8), _idx(4, high=8))),
    "fp32_opt": (Fp32OptOps, lambda: (_x(4, 8),)),
    "promote": (PromoteOps, lambda: (_x(4, 8),)),
    "follow": (FollowOps, lambda: (_x(4, 8),)),
    "integer": (IntegerPaths, lambda: (_idx(2, 6, high=10), _x(2, 6, 8))),
    "tuple_out": (TupleOut, lambda: (_x(4, 8),)),
    "dict_out": (DictOut, lambda: (_x(4, 8),)),
    "buffers": (Buffers, lambda: (_x(4, 8),)),
    "tied": (TiedLinears, lambda: (_idx(3, 5, high=12),)),
    "conv_bn": (ConvBN, lambda: (_x(3, 2, 4, 4),)),
    "functional_dropout": (FunctionalDropout, lambda: (_x(6, 8),)),
    "custom_function": (CustomFunction, lambda: (_x(4, 8),)),
    "mha": (MHA, lambda: (_x(2, 5, 8),)),
}

#: (model, target) pairs whose plan is wrong because of a known fxamp bug
_PLAN_BUGS: Dict[Tuple[str, str], str] = {}


def make(name: str) -> Tuple[nn.Module, tuple]:
    cls, inputs = MODELS[name]
    _seed(0)
    model = cls()
    model.train()
    return model, inputs()


def _truth_graph(name: str, model: nn.Module) -> Any:
    """What to run under autocast for the truth: plain symbolic_trace, except where the plain
    tracer cannot trace the model (the custom Function branches on x.dtype); there the graph
    fxamp traced (same node names, the Function kept as one call) is used."""
    if name == "custom_function":
        return fxamp_trace(model)
    return fx.symbolic_trace(model)


def _leaves(value: Any) -> List[Any]:
    if isinstance(value, dict):
        return [leaf for k in sorted(value) for leaf in _leaves(value[k])]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _params(name: str, configs, bugs: Dict[Tuple[str, str], str]) -> list:
    out = []
    for cfg in configs:
        for model in MODELS:
            reason = bugs.get((model, cfg[0]))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(model, cfg, id=f"{model}-{_cfg_id(cfg)}", marks=marks))
    return out


def _run_seeded(gm: nn.Module, inputs: tuple, seed: int = 7) -> Any:
    _seed(seed)
    with torch.no_grad():
        return gm(*inputs)


# ---------------------------------------------------------------------------------------
# plan == autocast, outputs == autocast
# ---------------------------------------------------------------------------------------
@pytest.mark.floor
@pytest.mark.parametrize("name, cfg", _params("plan", CONFIGS, _PLAN_BUGS))
def test_planned_dtypes_equal_autocast(name, cfg):
    target, dtype = cfg
    model, inputs = make(name)
    # torch.fx's tracer stores tensors computed at trace time on the root module as
    # _tensor_constantN, numbering on from what is already there: trace a copy made before
    # fxamp traces so that both graphs name those constants alike.
    truth_graph = _truth_graph(name, copy.deepcopy(model))
    gm = autocast_rewrite(model, inputs, dtype=dtype, target=target)
    plan = fxamp.plan_of(gm)
    truth = record_autocast_dtypes(truth_graph, inputs, target, dtype)
    assert truth, "autocast recorded nothing"
    planned = {n: p.dtype for n, p in plan.nodes.items()}
    wrong = {n: (planned.get(n), d) for n, d in truth.items() if planned.get(n) != d}
    assert not wrong, f"node: (planned, autocast) differ: {wrong}"
    assert set(planned) == set(truth), set(planned) ^ set(truth)
    # the rule is never "user" without a policy, and "runtime" exactly for opaque calls
    rules = {n: p.rule for n, p in plan.nodes.items()}
    assert "user" not in rules.values()
    expected_runtime = {"custom_function": {"dtype_branch_rms_apply"}, "mha": {"attn"}}
    if target == "cuda":
        # CUDA autocast runs F.cross_entropy's log_softmax in the input's dtype (the
        # composite passes it explicitly) and casts only the log-probabilities to fp32 for
        # nll_loss: no cast of the inputs does that, so the call runs under autocast
        expected_runtime["fp32"] = {"cross_entropy"}
    assert {n for n, r in rules.items() if r == "runtime"} == expected_runtime.get(name, set())


def test_categories_are_visible_in_the_plan():
    """Spot checks that each op-list category is planned as its category says."""
    inputs = MODELS["fp32"][1]()
    cuda = fxamp.plan_of(autocast_rewrite(make("fp32")[0], inputs, target="cuda")).nodes
    cpu = fxamp.plan_of(autocast_rewrite(make("fp32")[0], inputs, dtype=torch.bfloat16,
                                          target="cpu")).nodes
    assert cuda["fc"].dtype == torch.float16 and cuda["fc"].inputs == torch.float16
    for name in ("exp", "log", "pow_1", "truediv", "rsqrt", "ln", "gn", "mse_loss",
                 "layer_norm"):
        assert cuda[name].dtype == torch.float32 and cuda[name].inputs == torch.float32, name
    # CUDA autocast casts inside F.cross_entropy (its log_softmax keeps the input dtype)
    assert (cuda["cross_entropy"].dtype, cuda["cross_entropy"].rule) == (torch.float32,
                                                                         "runtime")
    assert "casts inside this call" in cuda["cross_entropy"].reason
    assert "fp32 list for cuda" in cuda["exp"].reason
    # on CPU only the losses are on the fp32 list; exp / layer_norm follow their inputs
    assert cpu["exp"].inputs is None and cpu["exp"].dtype == torch.bfloat16
    assert cpu["mse_loss"].inputs == torch.float32 and cpu["cross_entropy"].dtype == torch.float32

    opt = fxamp.plan_of(autocast_rewrite(make("fp32_opt")[0], MODELS["fp32_opt"][1](),
                                         target="cuda")).nodes
    assert opt["softmax"].inputs == torch.float32 and "no dtype given" in opt["softmax"].reason
    assert opt["cumsum_1"].inputs is None and opt["cumsum_1"].dtype == torch.float16
    assert "dtype it is given" in opt["log_softmax_1"].reason

    prom = fxamp.plan_of(autocast_rewrite(make("promote")[0], MODELS["promote"][1](),
                                           dtype=torch.bfloat16, target="cpu")).nodes
    assert prom["cat"].inputs == torch.float32 and "widest" in prom["cat"].reason
    assert prom["stack"].dtype == torch.float32


class EinsumMixed(nn.Module):
    """einsum of a low-precision activation and an fp32 weight: fine under CPU autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 6) / 3)

    def forward(self, x):
        return torch.einsum("bi,ij->bj", self.fc(x), self.w)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_einsum_of_mixed_operands_is_rewritten_like_autocast(cfg):
    # einsum is on no CPU list but runs bmm, which CPU autocast lowers: planned as 'follow',
    # the simulated bmm would see bf16 and fp32 operands and amp_rewrite would raise
    target, dtype = cfg
    _seed(0)
    model, inputs = EinsumMixed(), (_x(4, 8),)
    truth = record_autocast_dtypes(fx.symbolic_trace(copy.deepcopy(model)), inputs, target, dtype)
    assert truth["einsum"] == dtype
    gm = autocast_rewrite(model, inputs, dtype=dtype, target=target)
    assert fxamp.plan_of(gm).nodes["einsum"].dtype == dtype


def test_positional_dtype_counts_as_given():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.softmax(self.fc(x), -1, torch.float16)

    plan = fxamp.plan_of(autocast_rewrite(M(), (_x(4, 8),), target="cuda"))
    assert plan.nodes["softmax"].inputs is None, plan.nodes["softmax"]


@pytest.mark.floor
@pytest.mark.parametrize("name, cfg", _params("out", CPU_CONFIGS, {}))
def test_cpu_outputs_equal_autocast(name, cfg):
    _, dtype = cfg
    model, inputs = make(name)
    reference = copy.deepcopy(model)
    gm = autocast_rewrite(model, inputs, dtype=dtype, target="cpu")
    _seed(7)
    ref = run_autocast_cpu(reference, inputs, dtype)
    out = _run_seeded(gm, inputs)
    assert type(out) is type(ref)
    if isinstance(ref, dict):
        assert list(out) == list(ref)
    out_leaves, ref_leaves = _leaves(out), _leaves(ref)
    assert len(out_leaves) == len(ref_leaves)
    for o, r in zip(out_leaves, ref_leaves):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r, rtol=0, atol=0)  # see the module docstring


# ---------------------------------------------------------------------------------------
# parameters, gradients, integer values, casts
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_gm_shares_parameters_with_the_model(name):
    model, inputs = make(name)
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")
    gm_ids = {id(p) for p in gm.parameters()}
    assert gm_ids <= {id(p) for p in model.parameters()}
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # model untouched


def test_tied_parameters_stay_tied_and_are_cast_once():
    model, inputs = make("tied")
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")
    assert len(list(gm.parameters())) == len(list(model.parameters())) == 4
    weight_casts = [n for n in gm.graph.nodes if is_cast_node(n) and n.args[0].op == "get_attr"]
    sources = [n.args[0].target for n in weight_casts]
    assert len(sources) == len(set(sources)), f"a weight is cast twice: {sources}"
    # fc1/fc2 share one weight; head shares the embedding's: 2 weights + 2 biases cast
    assert len(weight_casts) == 4, sources


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_are_fp32_and_land_on_the_original_parameters(name):
    model, inputs = make(name)
    reference = copy.deepcopy(model)
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")

    def loss_of(out):
        return sum(t.float().sum() for t in _leaves(out)
                   if isinstance(t, torch.Tensor) and t.is_floating_point())

    _seed(3)
    loss_of(gm(*inputs)).backward()
    _seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = loss_of(reference(*inputs))
    ref_loss.backward()
    got = dict(model.named_parameters())
    want = dict(reference.named_parameters())
    assert list(got) == list(want)
    assert any(p.grad is not None for p in got.values())
    for pname, p in got.items():
        r = want[pname]
        assert (p.grad is None) == (r.grad is None), pname
        if p.grad is not None:
            assert p.grad.dtype == torch.float32, pname
            # same casts, same kernels forward and backward: equal up to the summation
            # order of the float loss (bf16 values, fp32 accumulation)
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=pname)


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: Dict[str, Any] = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _dtypes_of(value: Any) -> List[torch.dtype]:
    return [t.dtype for t in _leaves(value) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("name", ["integer", "buffers", "tied", "tuple_out", "dict_out",
                                  "fp32"])
def test_integer_and_bool_values_are_never_cast(name, cfg):
    target, dtype = cfg
    model, inputs = make(name)
    plain = fx.symbolic_trace(copy.deepcopy(model))  # see test_planned_dtypes_equal_autocast
    src_names = {n.name for n in plain.graph.nodes}
    gm = autocast_rewrite(model, inputs, dtype=dtype, target=target)
    rec = _Recorder(copy.deepcopy(gm))
    with torch.no_grad():
        rec.run(*inputs)
    inserted = [n for n in gm.graph.nodes if n.name not in src_names]
    casts = [n for n in inserted if n.op in ("call_method", "call_function")
             and n.target is not check_input_dtypes]  # (the graph's own input check)
    assert casts, "expected some inserted casts"
    for node in casts:
        assert is_cast_node(node), node.format_node()
        (value, to_dtype), kw = node.args[:2], node.kwargs
        assert not kw and isinstance(value, fx.Node)
        src_dtypes = _dtypes_of(rec.values[value.name])
        assert len(src_dtypes) == 1 and src_dtypes[0].is_floating_point, (
            f"{node.format_node()} casts a {src_dtypes} value")
        assert to_dtype in (torch.float32, dtype) and src_dtypes[0] != to_dtype
    # every integer / bool value of the original run has the same dtype in the rewritten run
    orig = _Recorder(plain)
    with torch.no_grad():
        orig.run(*inputs)
    for node_name, value in orig.values.items():
        for d_orig, d_new in zip(_dtypes_of(value), _dtypes_of(rec.values[node_name])):
            if not d_orig.is_floating_point:
                assert d_new == d_orig, node_name


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("name", list(MODELS))
def test_no_cast_of_a_cast_and_one_cast_per_value(name, cfg):
    target, dtype = cfg
    model, inputs = make(name)
    src_names = {n.name for n in fxamp_trace(copy.deepcopy(model)).graph.nodes}
    gm = autocast_rewrite(model, inputs, dtype=dtype, target=target)
    seen = set()
    for node in gm.graph.nodes:
        if node.name in src_names or not is_cast_node(node):
            continue
        value = node.args[0]
        if node.target is fan_out:  # a consumer's share of the one cast (no cast kernel)
            assert node.args[2].args[:2] == node.args[:2], node.format_node()
            continue
        # the value cast is a source node or a weight fetched for a functional call
        assert value.name in src_names or value.op == "get_attr", (
            f"cast of an inserted node: {node.format_node()}")
        key = (value.name, node.args[1])
        assert key not in seen, f"{value.name} cast to {node.args[1]} twice"
        seen.add(key)


# ---------------------------------------------------------------------------------------
# custom Function, MultiheadAttention (runtime leaves)
# ---------------------------------------------------------------------------------------
def test_custom_function_is_one_runtime_leaf_run_under_autocast():
    model, inputs = make("custom_function")
    with pytest.raises(Exception):  # the plain tracer cannot trace it (branch on x.dtype)
        fx.symbolic_trace(model)
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")
    node = fxamp.plan_of(gm).nodes["dtype_branch_rms_apply"]
    assert node.rule == "runtime" and node.inputs is None
    assert node.op.endswith("DtypeBranchRMS.apply")
    assert node.dtype == torch.bfloat16  # fc1's bf16 output went in as is
    calls = [n for n in gm.graph.nodes if n.name == "dtype_branch_rms_apply"]
    assert len(calls) == 1 and calls[0].op == "call_function"
    # the branch really saw bf16 at run time: eps=1e-3, not 1e-6
    h = F.linear(inputs[0].bfloat16(), model.fc1.weight.bfloat16(), model.fc1.bias.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model.fc2(DtypeBranchRMS.apply(h))
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_multihead_attention_is_a_runtime_leaf():
    model, inputs = make("mha")
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")
    plan = fxamp.plan_of(gm)
    assert plan.nodes["attn"].rule == "runtime" and plan.nodes["attn"].op == \
        "nn.MultiheadAttention"
    assert plan.nodes["attn"].dtype == torch.bfloat16
    # the MHA module itself is still shared (its in_proj / out_proj Parameters too)
    assert gm.get_submodule("attn") is model.attn


# ---------------------------------------------------------------------------------------
# BatchNorm, dropout, train / eval
# ---------------------------------------------------------------------------------------
def _bn_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()
            if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("policy, dtype", [(None, torch.bfloat16), (None, torch.float16),
                                           ("fp32:*", torch.bfloat16)])
def test_batchnorm_running_stats_update_like_the_original(policy, dtype):
    model, inputs = make("conv_bn")
    reference = copy.deepcopy(model)
    before = _bn_state(model)
    gm = autocast_rewrite(model, inputs, dtype=dtype, target="cpu", policy=policy)
    assert _bn_state(model).keys() == before.keys()
    for k, v in _bn_state(model).items():  # amp_rewrite itself changes no state
        assert torch.equal(v, before[k]), k
    _seed(5)
    gm(*inputs)
    _seed(5)
    if policy is None:  # the same forward under autocast
        with torch.autocast("cpu", dtype=dtype):
            reference(*inputs)
    else:  # everything in fp32: the FP32 model
        reference(*inputs)
    after, want = _bn_state(model), _bn_state(reference)
    assert after["bn.num_batches_tracked"].item() == 1
    assert not torch.equal(after["bn.running_mean"], before["bn.running_mean"])
    for k in want:
        assert after[k].dtype == want[k].dtype == before[k].dtype, k
        torch.testing.assert_close(after[k], want[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("name", ["conv_bn", "functional_dropout"])
def test_train_and_eval_toggle_dropout_and_batchnorm(name):
    model, inputs = make(name)
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")
    assert gm.training
    # train: dropout is active (different masks) and BN stats move
    stats0 = _bn_state(model)
    _seed(1)
    a = gm(*inputs)
    _seed(2)
    b = gm(*inputs)
    assert not torch.equal(a, b)
    assert _bn_state(model)["bn.num_batches_tracked"].item() == 2
    # eval: deterministic, BN uses and keeps its running stats, like the original in eval
    assert gm.eval() is gm and not gm.training
    stats1 = _bn_state(model)
    _seed(1)
    c = gm(*inputs)
    _seed(2)
    d = gm(*inputs)
    assert torch.equal(c, d)
    for k, v in _bn_state(model).items():
        assert torch.equal(v, stats1[k]), k
    reference = copy.deepcopy(model).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(c, reference(*inputs), rtol=0, atol=0)
    # and back to train
    gm.train()
    _seed(1)
    e = gm(*inputs)
    assert not torch.equal(e, c)
    assert not torch.equal(stats0["bn.running_mean"], _bn_state(model)["bn.running_mean"])


@pytest.mark.parametrize("name", [
    "conv_bn",
    "functional_dropout"])
def test_rewrite_keeps_a_frozen_batchnorm_frozen(name):
    model, inputs = make(name)
    model.train()
    model.bn.eval()  # common fine-tuning setup: frozen BN statistics
    before = _bn_state(model)
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")
    assert model.bn.training is False, "amp_rewrite switched the user's frozen BN to train"
    gm(*inputs)
    assert torch.equal(_bn_state(model)["bn.running_mean"], before["bn.running_mean"])


# ---------------------------------------------------------------------------------------
# in-place ops and cached casts
# ---------------------------------------------------------------------------------------
class InplaceAfterCast(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        h = x * 2
        a = self.fc1(h)          # casts h to the low dtype
        if self.how == "method":
            h.mul_(100.0)
        elif self.how == "view":
            h.narrow(1, 0, 1).mul_(100.0)
        elif self.how == "inplace_kwarg":
            F.relu(h - 0.5, inplace=True).mul_(0)  # mutates a temporary, not h
            F.hardtanh(h, -0.1, 0.1, inplace=True)
        else:
            torch.add(x, 100.0, out=h)
        b = self.fc2(h)          # must see the changed h
        return a + b


@pytest.mark.parametrize("how", [
    "method", "view", "inplace_kwarg",
    "out"])
def test_casts_are_not_reused_after_an_in_place_change(how):
    _seed(0)
    model, inputs = InplaceAfterCast(how), (_x(4, 8),)
    gm = autocast_rewrite(model, inputs, dtype=torch.bfloat16, target="cpu")
    ref = run_autocast_cpu(model, inputs, torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("target, node", [("cuda", "bmm"), ("cuda", "fc"), ("cpu", "conv"),
                                          ("cpu", "scaled_dot_product_attention")])
def test_one_override_changes_exactly_that_node(target, node):
    model, inputs = make("lower")
    a = fxamp.plan_of(autocast_rewrite(model, inputs, target=target)).nodes
    gm = autocast_rewrite(model, inputs, target=target, policy=f"fp32:{node}")
    b = fxamp.plan_of(gm).nodes
    assert list(a) == list(b)
    assert a[node].dtype == torch.float16 and a[node].rule == "autocast"
    assert b[node].dtype == torch.float32 and b[node].rule == "user"
    assert b[node].inputs == torch.float32 and f"fp32:{node}" in b[node].reason
    # only that node changes rule; nodes on no list downstream of it follow its new fp32
    # output (their dtype changes, their rule and reason do not)
    changed = {n for n in a if a[n] != b[n]} - {node}
    graph = {n.name: n for n in gm.graph.nodes}
    downstream, todo = set(), [graph[node]]
    while todo:
        for user in todo.pop().users:
            if user.name not in downstream:
                downstream.add(user.name)
                todo.append(user)
    for n in changed:
        assert n in downstream, n
        assert (b[n].rule, b[n].reason, b[n].inputs) == (a[n].rule, a[n].reason, a[n].inputs)
        assert b[n].reason == "on no autocast list: follows its inputs"
        assert b[n].dtype == torch.float32
    assert {n for n in b if b[n].rule == "user"} == {node}


def test_override_by_module_glob_and_op_label():
    model, inputs = make("follow")
    plan = fxamp.plan_of(autocast_rewrite(
        model, inputs, policy="compute=fp16,target=cpu,fp32:fc2,bf16:F.gelu")).nodes
    assert plan["fc2"].rule == "user" and plan["fc2"].dtype == torch.float32
    assert plan["gelu"].rule == "user" and plan["gelu"].dtype == torch.bfloat16
    assert plan["fc1"].rule == "autocast" and plan["fc1"].dtype == torch.float16
    assert {n for n, p in plan.items() if p.rule == "user"} == {"fc2", "gelu"}


class AttentionLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x):
        att = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1)
        return att @ x


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([AttentionLayer(), AttentionLayer()])

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class EncoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.encoder(x))


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("pattern, prefix", [
    ("encoder.*", "encoder"),
    ("encoder.layer.0.*", "encoder.layer.0")])
def test_module_glob_override_covers_everything_inside_the_module(pattern, prefix):
    _seed(0)
    model, inputs = EncoderModel(), (_x(2, 4, 8),)
    plan = fxamp.plan_of(autocast_rewrite(model, inputs, target="cuda",
                                           policy=f"fp32:{pattern}")).nodes
    inside = {n for n, p in plan.items() if _inside(p.module, prefix)}
    assert {"softmax", "encoder_layer_0_q"} <= inside
    for n, p in plan.items():
        if n in inside:
            assert p.rule == "user" and p.dtype == torch.float32, (n, p.module, p.rule)
        elif p.op != "placeholder":
            assert p.rule == "autocast", (n, p.module)


def test_output_dtype_policy_casts_floating_outputs_only():
    model, inputs = make("integer")
    for out_dtype, text in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        gm = autocast_rewrite(model, inputs, dtype=torch.float16, target="cpu",
                               policy=f"output={text}")
        with torch.no_grad():
            h, again, nxt, mask = gm(*inputs)
        assert h.dtype == again.dtype == out_dtype
        assert nxt.dtype == torch.int64 and mask.dtype == torch.bool


@pytest.mark.parametrize("name", list(MODELS))
def test_all_fp32_policy_is_bit_identical_to_the_fp32_model(name):
    model, inputs = make(name)
    reference = copy.deepcopy(model)
    gm = autocast_rewrite(model, inputs, dtype=torch.float16, target="cuda", policy="fp32:*")
    plan = fxamp.plan_of(gm)
    assert all(p.rule == "user" and p.inputs == torch.float32 for n, p in plan.nodes.items()
               if p.op not in ("placeholder", "get_attr"))
    graph = {n.name: n for n in gm.graph.nodes}
    for n, p in plan.nodes.items():  # fp32, unless the model itself asks for a dtype
        assert p.dtype == torch.float32 or graph[n].kwargs.get("dtype") == p.dtype, n
    _seed(9)
    with torch.no_grad():
        out = gm(*inputs)
    _seed(9)
    with torch.no_grad():
        ref = reference(*inputs)
    out_leaves, ref_leaves = _leaves(out), _leaves(ref)
    assert len(out_leaves) == len(ref_leaves)
    for o, r in zip(out_leaves, ref_leaves):
        assert o.dtype == r.dtype and torch.equal(o, r)


# ---------------------------------------------------------------------------------------
# bad input and error messages
# ---------------------------------------------------------------------------------------
def test_not_a_module():
    with pytest.raises(fxamp.FxampError, match="nn.Module"):
        autocast_rewrite(lambda x: x * 2, (_x(2, 2),))


def test_half_model_is_refused_with_the_fix():
    model, inputs = make("follow")
    model.half()
    with pytest.raises(fxamp.FxampError) as info:
        autocast_rewrite(model, tuple(t.half() for t in inputs))
    msg = str(info.value)
    assert "model.float()" in msg and "fc1.weight" in msg and "float16" in msg


def test_float64_dtype_is_a_policy_error():
    model, inputs = make("follow")
    with pytest.raises(fxamp.PolicyError) as info:
        autocast_rewrite(model, inputs, dtype=torch.float64)
    assert isinstance(info.value, fxamp.FxampError)
    assert "float64" in str(info.value) and "torch.float16" in str(info.value)


def test_unknown_target():
    model, inputs = make("follow")
    with pytest.raises(fxamp.FxampError) as info:
        autocast_rewrite(model, inputs, target="tpu")
    assert "'tpu'" in str(info.value) and "cuda" in str(info.value) and "cpu" in str(info.value)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_rewriting_the_output_again(cfg):
    target, dtype = cfg
    model, inputs = make("fp32")
    gm = autocast_rewrite(model, inputs, dtype=dtype, target=target)

    def n_casts(g):
        return sum(1 for n in g.graph.nodes if is_cast_node(n))

    count, text, code = n_casts(gm), fxamp.plan_of(gm).to_text(), gm.code
    with torch.no_grad():
        before = _leaves(gm(*inputs))
    again = autocast_rewrite(gm, inputs, dtype=dtype, target=target)
    # same settings: the rewritten module comes back as it was, not rewritten a second time
    # (no casts of casts); compared with what it was before the call, not with itself
    assert again is gm
    assert gm.code == code and fxamp.plan_of(gm).to_text() == text
    assert n_casts(gm) == count > 0
    with torch.no_grad():
        after = _leaves(again(*inputs))
    assert len(after) == len(before) > 0
    for o, r in zip(after, before):
        assert torch.equal(o, r)
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    for kwargs in ({"dtype": other, "target": target},
                   {"dtype": dtype, "target": "cpu" if target == "cuda" else "cuda"},
                   {"dtype": dtype, "target": target, "policy": "fp32:fc"}):
        with pytest.raises(fxamp.FxampError) as info:
            autocast_rewrite(gm, inputs, **kwargs)
        assert "already rewritten" in str(info.value) and "original FP32 model" in str(
            info.value)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if x.sum() > 0:
            h = h * 2
        return h


def test_untraceable_model_names_the_line_and_the_fix():
    with pytest.raises(fxamp.TraceError) as info:  # (frontend="auto" runs it eagerly)
        autocast_rewrite(DataDependent(), (_x(4, 8),), frontend="fx")
    msg = str(info.value)
    assert isinstance(info.value, fxamp.FxampError)
    assert "DataDependent" in msg
    assert os.path.basename(__file__) in msg and "if x.sum() > 0" in msg
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1)
                if "if x.sum() > 0:" in text)
    assert f"line {line}" in msg
    assert "what to do" in msg and "traceable" in msg


class WithBCE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, y):
        return F.binary_cross_entropy(torch.sigmoid(self.fc(x)), y)


def test_binary_cross_entropy_for_cuda_is_refused_with_the_fix():
    inputs = (_x(4, 8), torch.rand(4, 1))
    with pytest.raises(fxamp.FxampError) as info:
        autocast_rewrite(WithBCE(), inputs, target="cuda")
    msg = str(info.value)
    assert "BCEWithLogits" in msg and "binary_cross_entropy" in msg
    assert "fp32:binary_cross_entropy" in msg  # the override that keeps it
    assert os.path.basename(__file__) in msg  # the source line of the node
    # the suggested override works; on CPU (where autocast runs it in fp32) it is fine too
    gm = autocast_rewrite(WithBCE(), inputs, target="cuda", policy="fp32:binary_cross_entropy")
    assert fxamp.plan_of(gm).nodes["binary_cross_entropy"].rule == "user"
    plan = fxamp.plan_of(autocast_rewrite(WithBCE(), inputs, dtype=torch.bfloat16,
                                           target="cpu")).nodes
    assert plan["binary_cross_entropy"].dtype == torch.float32
