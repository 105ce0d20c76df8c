"""Ground truth for autocast behaviour, used by the fxamp tests.

``record_autocast_dtypes`` runs an (unrewritten, FP32) ``torch.fx`` graph node
by node under real autocast and reports the dtype each node produced.  For the
``"cuda"`` target on a machine without a GPU it uses FakeTensors on the
``cuda`` device: the CUDA autocast kernels are registered for the
``AutocastCUDA`` dispatch key and run on fake CUDA tensors, so only the
thread-local autocast flag has to be set by hand (``torch.autocast("cuda")``
itself refuses to start without CUDA).

``autocast_category_probes`` / ``observed_category`` classify single torch
calls into autocast categories by observation ("lower", "fp32", "follow",
"promote").
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = [
    "Probe",
    "autocast_category_probes",
    "has_autocast_kernel",
    "observe_all",
    "observed_category",
    "record_autocast_dtypes",
    "run_autocast_cpu",
]

_TARGETS = ("cpu", "cuda")


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _tensor_leaves(value: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors inside ``value`` (tensors, lists, tuples, dicts), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensor_leaves(item)


def _first_float_dtype(value: Any) -> torch.dtype | None:
    """Dtype of the first floating-point tensor in ``value``, or None."""
    for t in _tensor_leaves(value):
        if t.is_floating_point():
            return t.dtype
    return None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nested list/tuple/dict structure."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value


def _check_target(target: str) -> None:
    if target not in _TARGETS:
        raise ValueError(f"target must be one of {_TARGETS}, got {target!r}")


def _real_cuda() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def _fake_cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Enable CUDA autocast via the thread-local flags (works without a GPU).

    Mirrors ``torch.autocast.__enter__/__exit__`` (nesting count and cast
    cache) and restores the previous flag and dtype afterwards.
    """
    prev_enabled = torch.is_autocast_enabled("cuda")
    prev_dtype = torch.get_autocast_dtype("cuda")
    torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_enabled("cuda", True)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev_enabled)
        torch.set_autocast_dtype("cuda", prev_dtype)


def _fake_cuda_like(t: torch.Tensor) -> torch.Tensor:
    """A fake tensor on ``cuda`` with ``t``'s shape, stride and dtype.

    Must be called with a ``FakeTensorMode`` active.  Parameters stay
    parameters (with their ``requires_grad``); integer tensors stay integer.
    """
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    if t.requires_grad:
        fake.requires_grad_(True)
    return fake


def _module_tensors(gm: nn.Module) -> list[torch.Tensor]:
    """All tensors held by ``gm``: parameters, buffers and plain tensor attributes."""
    found: dict[int, torch.Tensor] = {}
    for _, p in gm.named_parameters(remove_duplicate=False):
        found[id(p)] = p
    for _, b in gm.named_buffers(remove_duplicate=False):
        found[id(b)] = b
    for _, m in gm.named_modules(remove_duplicate=False):
        for v in vars(m).values():
            if isinstance(v, torch.Tensor):
                found[id(v)] = v
    return list(found.values())


def _fake_cuda_copy(gm: nn.Module) -> nn.Module:
    """Deep copy of ``gm`` whose tensors are fake CUDA tensors.

    The fake tensors are pre-seeded into the deepcopy memo, so the real
    weights are never copied and the user's module is left untouched
    (tied parameters stay tied).  Call with a ``FakeTensorMode`` active.
    """
    memo: dict[int, Any] = {}
    for t in _module_tensors(gm):
        memo[id(t)] = _fake_cuda_like(t)
    return copy.deepcopy(gm, memo)


class _DtypeRecorder(torch.fx.Interpreter):
    """Interpreter that records the floating dtype produced by each node."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.dtypes: dict[str, torch.dtype] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.op != "output":
            dt = _first_float_dtype(result)
            if dt is not None:
                self.dtypes[n.name] = dt
        return result


def _as_graph_module(model: nn.Module) -> torch.fx.GraphModule:
    if isinstance(model, torch.fx.GraphModule):
        return model
    return torch.fx.symbolic_trace(model)


# --------------------------------------------------------------------------
# public API: whole graphs
# --------------------------------------------------------------------------


def record_autocast_dtypes(
    gm: torch.fx.GraphModule,
    example_inputs: tuple,
    target: str,
    dtype: torch.dtype,
) -> dict[str, object]:
    """Run ``gm`` under autocast and return ``node.name -> result dtype``.

    Only nodes (other than ``output``) producing a floating tensor are
    recorded; for tuple/list/dict results the first floating tensor counts.
    ``target`` is ``"cpu"`` (real tensors) or ``"cuda"`` (real CUDA if
    available, otherwise fake CUDA tensors with the CUDA autocast flag set).
    The user's module is never modified: a deep copy is run, under no_grad.
    A plain ``nn.Module`` is accepted too and symbolically traced first.
    """
    _check_target(target)
    gm = _as_graph_module(gm)
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)

    if target == "cpu":
        work = copy.deepcopy(gm)
        rec = _DtypeRecorder(work)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            rec.run(*example_inputs)
        return dict(rec.dtypes)

    if _real_cuda():
        work = copy.deepcopy(gm).to("cuda")
        inputs = _map_tensors(example_inputs, lambda t: t.to("cuda"))
        rec = _DtypeRecorder(work)
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            rec.run(*inputs)
        return dict(rec.dtypes)

    mode = FakeTensorMode()
    with mode:
        work = _fake_cuda_copy(gm)
        inputs = _map_tensors(example_inputs, _fake_cuda_like)
        rec = _DtypeRecorder(work)
        with torch.no_grad(), _fake_cuda_autocast(dtype):
            rec.run(*inputs)
    return dict(rec.dtypes)


def run_autocast_cpu(
    model_or_gm: nn.Module, example_inputs: tuple, dtype: torch.dtype
) -> Any:
    """Output of ``model_or_gm(*example_inputs)`` under CPU autocast.

    Runs a deep copy under ``torch.no_grad`` so the model's state (e.g.
    BatchNorm running stats) is unchanged.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    work = copy.deepcopy(model_or_gm)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return work(*example_inputs)


# --------------------------------------------------------------------------
# public API: single-op category probes
# --------------------------------------------------------------------------


class Probe(NamedTuple):
    """A torch-level call to classify.

    ``make_inputs(d)`` returns the argument tuple with every floating tensor
    in dtype ``d`` (integer tensors, e.g. class targets, stay integer).
    ``mixed`` marks ops whose promote behaviour matters: ``observed_category``
    then also runs them with the first floating input in fp32 and the rest in
    the low dtype.
    """

    fn: Callable[..., Any]
    make_inputs: Callable[[torch.dtype], tuple]
    mixed: bool = False


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _floats(*tensors: torch.Tensor) -> Callable[[torch.dtype], tuple]:
    """``make_inputs`` returning ``tensors`` cast to the requested dtype."""
    return lambda d: tuple(t.to(d) for t in tensors)


def autocast_category_probes() -> dict[str, Probe]:
    """A table of simple torch calls, name -> :class:`Probe`."""
    x = _randn(4, 8)
    pos = x.abs() + 0.5
    img = _randn(1, 2, 4, 4, seed=1)
    grid = torch.rand(1, 3, 3, 2, generator=torch.Generator().manual_seed(2)) * 2 - 1
    cls = torch.tensor([0, 3, 7, 1])
    q = _randn(1, 2, 4, 8, seed=3)
    w = _randn(6, 8, seed=4)
    b = _randn(6, seed=5)
    ln_w = _randn(8, seed=6)
    a3 = _randn(2, 4, 8, seed=7)
    b3 = _randn(2, 8, 3, seed=8)
    bn_x = _randn(4, 2, 3, seed=9)

    return {
        # matmul-like
        "matmul": Probe(lambda t: t @ t.T, _floats(x)),
        "linear": Probe(F.linear, _floats(x, w, b)),
        "bmm": Probe(torch.bmm, _floats(a3, b3)),
        "sdpa": Probe(F.scaled_dot_product_attention, _floats(q, q, q)),
        # pointwise / activations
        "relu": Probe(torch.relu, _floats(x)),
        "gelu": Probe(F.gelu, _floats(x)),
        "exp": Probe(torch.exp, _floats(x)),
        "pow": Probe(lambda t: torch.pow(t, 2), _floats(x)),
        "rdiv": Probe(lambda t: 1 / t, _floats(pos)),
        "rsqrt": Probe(torch.rsqrt, _floats(pos)),
        # reductions
        "sum": Probe(torch.sum, _floats(x)),
        "cumsum": Probe(lambda t: torch.cumsum(t, -1), _floats(x)),
        "norm": Probe(torch.norm, _floats(x)),
        "normalize": Probe(F.normalize, _floats(x)),
        "logsumexp": Probe(lambda t: torch.logsumexp(t, -1), _floats(x)),
        "softmax": Probe(lambda t: torch.softmax(t, -1), _floats(x)),
        "log_softmax": Probe(lambda t: torch.log_softmax(t, -1), _floats(x)),
        # normalisation
        "layer_norm": Probe(lambda t: F.layer_norm(t, (8,)), _floats(x)),
        "rms_norm": Probe(lambda t: F.rms_norm(t, (8,)), _floats(x)),
        "batch_norm": Probe(
            lambda t: F.batch_norm(t, torch.zeros(2, device=t.device), torch.ones(2, device=t.device)),
            _floats(bn_x),
        ),
        # losses
        "mse_loss": Probe(F.mse_loss, _floats(x, x.flip(0))),
        "cross_entropy": Probe(F.cross_entropy, lambda d: (x.to(d), cls)),
        # resampling
        "interpolate_nearest": Probe(
            lambda t: F.interpolate(t, scale_factor=2, mode="nearest"), _floats(img)
        ),
        "grid_sample": Probe(
            lambda t, g: F.grid_sample(t, g, align_corners=False), _floats(img, grid), mixed=True
        ),
        # mixed-input ops
        "cat": Probe(lambda s, t: torch.cat([s, t]), _floats(x, x), mixed=True),
        "stack": Probe(lambda s, t: torch.stack([s, t]), _floats(x, x), mixed=True),
        "addcmul": Probe(lambda s, t: torch.addcmul(s, s, t), _floats(x, x), mixed=True),
        "layer_norm_affine": Probe(
            lambda t, wt, bs: F.layer_norm(t, (8,), wt, bs), _floats(x, ln_w, ln_w), mixed=True
        ),
        "add": Probe(torch.add, _floats(x, x), mixed=True),
    }


def _run_under_autocast(
    fn: Callable[..., Any], inputs: tuple, target: str, dtype: torch.dtype
) -> torch.dtype | None:
    """Run ``fn(*inputs)`` under autocast for ``target``; first floating output dtype."""
    if target == "cpu":
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            return _first_float_dtype(fn(*inputs))
    if _real_cuda():
        inputs = _map_tensors(inputs, lambda t: t.to("cuda"))
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            return _first_float_dtype(fn(*inputs))
    with FakeTensorMode():
        fake_inputs = _map_tensors(inputs, _fake_cuda_like)
        with torch.no_grad(), _fake_cuda_autocast(dtype):
            return _first_float_dtype(fn(*fake_inputs))


def _mixed_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    """Keep the first floating tensor in fp32, cast the other floating ones to ``dtype``."""
    seen = False

    def cast(t: torch.Tensor) -> torch.Tensor:
        nonlocal seen
        if not t.is_floating_point():
            return t
        if not seen:
            seen = True
            return t.to(torch.float32)
        return t.to(dtype)

    return _map_tensors(inputs, cast)


def observed_category(
    fn: Callable[..., Any],
    make_inputs: Callable[[torch.dtype], tuple],
    target: str,
    dtype: torch.dtype,
    *,
    mixed: bool = False,
) -> str:
    """Classify ``fn`` by running it under autocast for ``target``.

    Runs with all-fp32 inputs and with all-``dtype`` inputs (plus, if
    ``mixed``, with the first floating input fp32 and the rest ``dtype``):

    * ``"lower"``: fp32 inputs give a ``dtype`` output;
    * ``"fp32"``: ``dtype`` inputs give an fp32 output;
    * ``"promote"``: (only if ``mixed``) the mixed run gives the widest input
      dtype (fp32).  Note ordinary type promotion (e.g. ``torch.add``) looks
      the same, observation cannot tell an autocast promote kernel from it;
    * ``"follow"``: output dtype equals the input dtype in both runs;
    * ``"unknown"``: anything else.
    """
    _check_target(target)
    out32 = _run_under_autocast(fn, make_inputs(torch.float32), target, dtype)
    if out32 == dtype:
        return "lower"
    outlow = _run_under_autocast(fn, make_inputs(dtype), target, dtype)
    if outlow == torch.float32:
        return "fp32"
    if mixed:
        try:
            outmix = _run_under_autocast(
                fn, _mixed_inputs(make_inputs(torch.float32), dtype), target, dtype
            )
        except RuntimeError:  # op rejects mixed dtypes: no promotion happened
            outmix = None
        if outmix == torch.float32:
            return "promote"
    if out32 == torch.float32 and outlow == dtype:
        return "follow"
    return "unknown"


def observe_all(target: str, dtype: torch.dtype) -> dict[str, str]:
    """``observed_category`` for every probe of :func:`autocast_category_probes`."""
    return {
        name: observed_category(p.fn, p.make_inputs, target, dtype, mixed=p.mixed)
        for name, p in autocast_category_probes().items()
    }


def has_autocast_kernel(op_name: str, target: str) -> bool:
    """Whether ``op_name`` (e.g. ``"aten::cat"``, ``"aten::add.Tensor"``) has a
    kernel registered for the Autocast dispatch key of ``target``.

    Complements :func:`observed_category`: ops such as ``cat`` and ``addcmul``
    type-promote natively, so "promote" cannot be told from plain type
    promotion by observation alone; this says whether autocast intervenes.
    """
    _check_target(target)
    key = "AutocastCPU" if target == "cpu" else "AutocastCUDA"
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key)


def autocast_rewrite(model: nn.Module, inputs: tuple, *, policy: str | None = None,
                     **kwargs: Any) -> torch.fx.GraphModule:
    """``fxamp.amp_rewrite`` with the numerics passes and cast placement off: the plan mirrors
    autocast exactly (and outputs keep their dtype), which is what the agreement tests check."""
    import fxamp

    text = "numerics=off,placement=off" + (f",{policy}" if policy else "")
    return fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(policy=text, **kwargs))
