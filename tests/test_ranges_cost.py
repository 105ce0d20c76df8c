"""The range measurement without masked copies (issue 51, "Deployment at real sizes"):
``passes.ranges.tensor_stats`` and the recorder built on it give exactly the numbers of the
straightforward masked computation (``t[isfinite(t)].abs()``, ``mags[mags > 0]``), and the
inner values' dot products leave the caller's tensors as they were."""
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxamp.passes import ranges
from fxamp.passes.inner_values import inner_peak
from fxamp.passes.ranges import CHUNK, Scratch, collect_ranges, tensor_stats

FP16_TINY = torch.finfo(torch.float16).tiny
BF16_TINY = torch.finfo(torch.bfloat16).tiny
SPECIALS = [0.0, -0.0, 1e-40, -1e-40, 1e-45, 5e-5, -5e-5, FP16_TINY, -FP16_TINY, 6.2e-5,
            BF16_TINY, 1.0, -2.0, 7e4, -7e4, 3.4e38, math.inf, -math.inf, math.nan]


def _reference(t, tiny):
    """The masked computation the recorder used to make: (largest finite magnitude,
    smallest finite magnitude, finite non-zero count, of those below tiny, non-finite)."""
    t = t.detach().float()
    finite = torch.isfinite(t)
    mags = t[finite].abs()
    nonzero = mags[mags > 0]
    top, low = (float(mags.max()), float(mags.min())) if mags.numel() else (None, None)
    return top, low, nonzero.numel(), int((nonzero < tiny).sum()), int((~finite).sum())


def _bits(values):
    """Floats with their sign of zero, so that 0.0 and -0.0 differ."""
    return tuple((v, math.copysign(1.0, v)) if isinstance(v, float) else v for v in values)


def _assert_same(t, tiny, scratch=None):
    got = tuple(tensor_stats(t, tiny, scratch))
    assert _bits(got) == _bits(_reference(t, tiny)), (t.dtype, tuple(t.shape), got)


def _values(generator, count):
    """``count`` values, half of them special (zeros, subnormals, inf, NaN...), half normal
    at a random scale."""
    pick = torch.randint(0, len(SPECIALS), (count,), generator=generator)
    special = torch.tensor(SPECIALS, dtype=torch.float64)[pick]
    scale = 10.0 ** (torch.rand(count, generator=generator, dtype=torch.float64) * 11 - 8)
    normal = torch.randn(count, generator=generator, dtype=torch.float64) * scale
    return torch.where(torch.rand(count, generator=generator) < 0.5, special, normal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("tiny", [FP16_TINY, BF16_TINY])
def test_fast_stats_equal_the_masked_reference_on_special_values(dtype, tiny):
    g = torch.Generator().manual_seed(0)
    scratch = Scratch()
    for size in (0, 1, 2, 7, 16, 33, 100, 1000):
        for trial in range(12):
            t = _values(g, size)
            if trial % 4 == 0:
                t = t.abs()  # every value positive (or zero)
            if trial % 4 == 1 and size % 2 == 0 and size:
                t = t.view(2, -1).t()  # a transpose: not contiguous
            t = t.to(dtype)
            _assert_same(t, tiny, scratch)
            _assert_same(t, tiny)  # fresh temporaries
    for t in (torch.tensor(-0.0), torch.tensor(math.nan), torch.tensor(3e-41),
              torch.full((5,), -0.0), torch.full((4,), math.inf), torch.empty(0, 3),
              torch.zeros(3, 0, dtype=torch.float16)):
        _assert_same(t.to(dtype), tiny, scratch)


def test_one_nan_or_inf_anywhere_is_seen():
    # aminmax must propagate NaN from every position of its vector lanes and tails
    g = torch.Generator().manual_seed(1)
    for size in range(1, 70):
        for at in range(size):
            for bad in (math.nan, math.inf, -math.inf):
                t = torch.randn(size, generator=g)
                t[at] = bad
                assert tensor_stats(t, FP16_TINY).nonfinite == 1
                _assert_same(t, FP16_TINY)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "expanded",
                                    "strided", "fp16"])
def test_tensors_of_several_chunks_and_views_equal_the_reference(layout):
    g = torch.Generator().manual_seed(2)
    n = 2 * CHUNK + 1234
    scratch = Scratch()
    for k in range(4):
        t = torch.randn(n, generator=g) * 10.0 ** (k - 3)
        if k:  # specials in some chunks (a NaN in one chunk leaves the others' numbers)
            at = torch.randint(0, n, (40,), generator=g)
            t[at] = _values(g, 40).float()
        flat = t[:2 * CHUNK]
        view = {"contiguous": t, "transposed": flat.view(4, -1).t(),
                "sliced": flat.view(4, -1)[:, 5:], "expanded": t[:7].expand(3, 7),
                "strided": flat.view(-1, 2)[::2], "fp16": t.half()}[layout]
        _assert_same(view, FP16_TINY, scratch)
        _assert_same(view, BF16_TINY, scratch)


def test_counts_past_float32s_integers_stay_exact():
    # one piece of more than 2**24 flags (a view that is no dense run): summed in FP64
    n = (1 << 24) + 3
    assert ranges._count(torch.ones(1).expand(n)) == n
    assert ranges._count(torch.ones(1 << 18)) == 1 << 18


class _Specials(nn.Module):
    """Outputs with zeros, -0.0, subnormals, inf and NaN, an FP16 and a BF16 value, an
    integer output and an empty one."""

    def forward(self, x):
        r = torch.relu(x)  # zeros
        small = x * 1e-42  # FP32 subnormals (and -0.0 where x is -0.0)
        inf = x / (r - r)  # inf where x > 0, NaN where x is 0
        half = (x * 1e-6).half()  # FP16 values, some subnormal in FP16
        brain = x.bfloat16() * 3
        ids = x.argmax(-1)  # integers: no range
        empty = x[:, :0] * 2
        neg_zero = torch.minimum(x, torch.zeros_like(x)) * 0  # -0.0 and 0.0
        return r, small, inf, half, brain, ids, empty, neg_zero


def _reference_ranges(gm, batches, tiny):
    """Each node's (max, small, nonzero, nonfinite) and smallest magnitude over the batches,
    by running the graph and masking every floating output."""
    acc, smallest = {}, {}
    for batch in batches:
        env = {}

        class Keep(fx.Interpreter):
            def run_node(self, n):
                env[n.name] = super().run_node(n)
                return env[n.name]

        Keep(gm).run(*batch)
        for node in gm.graph.nodes:
            value = env[node.name]
            leaves = value if isinstance(value, tuple) else (value,)
            floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if not floats or node.op == "output":
                continue
            a = acc.setdefault(node.name, [0.0, 0, 0, 0])
            for t in floats:
                top, low, nonzero, small, nonfinite = _reference(t, tiny)
                a[3] += nonfinite
                if top is not None:
                    a[0] = max(a[0], top)
                    smallest[node.name] = min(smallest.get(node.name, low), low)
                a[2] += nonzero
                a[1] += small
    return {name: (float(f"{a[0]:.6g}"), float(f"{a[1] / a[2] if a[2] else 0.0:.4f}"), a[3])
            for name, a in acc.items()}, smallest


def test_the_recorder_gives_the_masked_reference_ranges_node_by_node():
    gm = fx.symbolic_trace(_Specials())
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 8, generator=g),), (torch.randn(3, 8, generator=g) * 1e4,),
               (torch.tensor([[-0.0, 0.0, 1e-40, -2.0]]),)]
    for dtype in (torch.float16, torch.bfloat16):
        smallest = {}
        got = collect_ranges(gm, batches, dtype, inner={}, smallest=smallest, spread={})
        want, want_smallest = _reference_ranges(gm, batches, torch.finfo(dtype).tiny)
        assert {n: (s.max_abs, s.underflow, s.nonfinite) for n, s in got.items()} == want
        assert _bits(smallest.values()) == _bits(want_smallest.values())
        assert list(smallest) == list(want_smallest)
        assert "argmax" not in got and got["truediv"].nonfinite > 0  # integers: no range
        # FP32 subnormals: all below FP16's smallest normal, most below BF16's
        assert got["mul"].underflow == 1.0 if dtype == torch.float16 else got["mul"].underflow > 0.5
        assert got["getitem"] == ranges.RangeStats(0.0, 0.0, 0)  # empty


class _Dots(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 3, 3)
        self.fc = nn.Linear(6, 5)

    def forward(self, x, y):
        return (self.conv(x), self.fc(x), x @ y, torch.addmm(x[0, :1], x, y),
                F.scaled_dot_product_attention(x[None], x[None], x[None], scale=-0.5))


def test_inner_dot_products_leave_the_callers_tensors_and_equal_the_reference():
    """Each matmul-like op's inner peak (its dot products on magnitudes, bias left out),
    a Conv and a Linear module's included, equals the reference, and writes into no
    input."""
    gm = fx.symbolic_trace(_Dots())
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 6, generator=g), torch.randn(6, 6, generator=g)
    weight = gm.conv.weight.detach().clone()
    env = {"x": x, "y": y}
    want = {"conv": F.conv1d(x.abs(), weight.abs()).abs().max(),
            "fc": (x.abs() @ gm.fc.weight.detach().abs().t()).abs().max(),  # (a Linear
            # module, as the fx front end keeps it: it was never measured)
            "matmul": (x.abs() @ y.abs()).abs().max(),
            "addmm": (x.abs() @ y.abs()).abs().max(),
            "scaled_dot_product_attention": ((x.abs() @ x.abs().t()) * -0.5).abs().max()}
    seen = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function"):
            continue
        args = fx.node.map_arg(node.args, lambda a: env[a.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a.name])
        copies = [a.clone() for a in args if isinstance(a, torch.Tensor)]
        peak = inner_peak(node, gm, args, kwargs)
        if node.name in want:
            seen[node.name] = peak[0]
            assert peak[0] == float(want[node.name]) and peak[1].startswith("its dot products")
        for before, after in zip(copies, [a for a in args if isinstance(a, torch.Tensor)]):
            assert torch.equal(before, after), node.name  # the peak wrote into no input
        env[node.name] = (gm.get_submodule(node.target)(*args) if node.op == "call_module"
                          else node.target(*args, **kwargs))
    assert set(seen) == set(want) and torch.equal(gm.conv.weight, weight)
