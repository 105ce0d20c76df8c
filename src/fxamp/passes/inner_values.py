"""The numbers a node computes inside, from its input values: what a deployment plan judges
besides the node's inputs and output.

An FP16 engine computes a norm's statistics, a softmax's sum and a matmul's dot products in
FP16 too (``onnx.reference`` does, every op in its declared type), so a node whose output is
small can still overflow inside: a LayerNorm over values near 5000 squares its deviations
past 65504 and gives 0 everywhere. :func:`inner_peak` measures, on one call's real input
values:

* a norm (layer, group, instance, RMS) and ``var`` / ``std``: the sum of squared deviations
  per normalised group (the variance times the count; an RMS norm: the sum of squares);
* a softmax / log-softmax: the sum of ``exp(x - max)`` per output row;
* a sum / mean: the sum of ``|x|`` per output (it bounds every partial sum);
* a matmul, linear, convolution, attention: the largest dot product of magnitudes
  (``|a| @ |b|`` with the op itself: it bounds every partial accumulation).

Each is a ``(value, what)`` pair: ``what`` names the value for the plan's reason.

:func:`row_spread` measures how flat a LayerNorm's rows are: a row whose spread is a small
part of its magnitude (``3 + 1e-4 * x``) loses its spread when rounded to FP16, and a small
eps scales that rounding up to the output (``passes/norm_eps.py`` reads it).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from .._torch import CONV_BASE, CONV_TRANSPOSE_BASE, INSTANCE_NORM_BASE

Peak = Tuple[float, str]
#: (the smallest ratio of a row's normalising spread to its magnitude, that row's spread,
#: that row's magnitude, the LayerNorm's eps)
Spread = Tuple[float, float, float, float]

_SUM_OF_SQUARES = "its variance's sum of squares"


def op_name(node: fx.Node, root: nn.Module) -> str:
    """A short name for the computation of ``node``: ``layer_norm``, ``linear``, ``conv``..."""
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        for kind, name in _MODULES:
            if isinstance(module, kind):
                return name
        return ""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", "").split(".")[0]
    return ""


def _dims(x: torch.Tensor, dim: Any) -> Optional[Tuple[int, ...]]:
    if dim is None:
        return tuple(range(x.dim()))
    if isinstance(dim, int):
        return (dim,)
    if isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        return tuple(dim) if dim else tuple(range(x.dim()))
    return None


def _sum_sq_dev(x: torch.Tensor, dims: Sequence[int], centred: bool = True) -> float:
    x = x.double()
    dev = x - x.mean(dim=tuple(dims), keepdim=True) if centred else x
    return float(dev.pow(2).sum(dim=tuple(dims)).max()) if x.numel() else 0.0


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _normalised(module: Optional[nn.Module], args: tuple, kwargs: dict
                ) -> Optional[Tuple[torch.Tensor, int]]:
    """A LayerNorm's or RMSNorm's floating input and how many trailing dimensions it
    normalises over (from the module, else the call's ``normalized_shape``); None where
    there is none."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
        return None
    shape = (module.normalized_shape if module is not None  # type: ignore[union-attr]
             else _arg(args, kwargs, 1, "normalized_shape"))
    if shape is None:
        return None
    return x, len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1


def _norm(module: Optional[nn.Module], args: tuple, kwargs: dict, kind: str) -> Optional[Peak]:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
        return None
    if kind in ("layer_norm", "rms_norm"):
        found = _normalised(module, args, kwargs)
        if found is None:
            return None
        dims = tuple(range(x.dim() - found[1], x.dim()))
        centred = kind == "layer_norm"
        return (_sum_sq_dev(x, dims, centred),
                _SUM_OF_SQUARES if centred else "its sum of squares")
    if kind == "group_norm":
        groups = (module.num_groups if module is not None  # type: ignore[union-attr]
                  else _arg(args, kwargs, 1, "num_groups"))
        if not isinstance(groups, int) or x.dim() < 2 or x.shape[1] % groups:
            return None
        return _sum_sq_dev(x.reshape(x.shape[0], groups, -1), (2,)), _SUM_OF_SQUARES
    if kind == "instance_norm" and x.dim() > 2:
        return _sum_sq_dev(x, tuple(range(2, x.dim()))), _SUM_OF_SQUARES
    return None


def _statistic(args: tuple, kwargs: dict, kind: str) -> Optional[Peak]:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
        return None
    dims = _dims(x, _arg(args, kwargs, 1, "dim"))
    if dims is None:
        return None
    if kind in ("var", "std", "var_mean", "std_mean"):
        return _sum_sq_dev(x, dims), "its sum of squared deviations"
    if kind in ("softmax", "log_softmax", "_softmax", "_log_softmax"):
        d = dims[0]
        x = x.double()
        total = torch.exp(x - x.amax(dim=d, keepdim=True)).sum(dim=d)
        return float(total.max()), "its sum of exp"
    return float(x.double().abs().sum(dim=dims).max()), "its accumulation (the sum of |x|)"


def _abs(value: Any) -> Any:
    return value.abs() if isinstance(value, torch.Tensor) and value.is_floating_point() \
        else value


def _dot(call: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[Peak]:
    """The op itself on magnitudes, biases left out: the largest sum of |a_i| |b_i|."""
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if len(floats) < 2:
        return None
    with torch.no_grad():
        out = call(*[_abs(a) for a in args], **{k: _abs(v) for k, v in kwargs.items()})
        out = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(out, torch.Tensor) or not out.numel():
            return None
        # in place: ``out`` is computed from the copies ``_abs`` made (a 50257-word
        # vocabulary's logits are 50 MB a batch), never the caller's tensors
        return float(out.abs_().max()), "its dot products (|a| @ |b|)"


def _no_bias(fn: Callable[..., Any], bias_at: int) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(None if i == bias_at else a for i, a in enumerate(args))
        kwargs = {k: (None if k == "bias" else v) for k, v in kwargs.items()}
        return fn(*args, **kwargs)
    return call


def _sdpa_scores(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
    return (q @ k.transpose(-1, -2)) * scale


def _conv_module(module: nn.Module) -> Callable[..., Any]:
    def call(x: torch.Tensor) -> Any:
        weight = module.weight.abs()  # type: ignore[union-attr]
        return module._conv_forward(x, weight, None)  # type: ignore[operator]
    return call


_NORMS = ("layer_norm", "group_norm", "instance_norm", "rms_norm")
_STATS = ("var", "std", "var_mean", "std_mean", "softmax", "log_softmax", "_softmax",
          "_log_softmax", "sum", "mean", "nansum", "nanmean")
_MATMULS: Dict[str, Callable[..., Any]] = {
    "mm": torch.mm, "bmm": torch.bmm, "matmul": torch.matmul, "__matmul__": torch.matmul,
    "linear": _no_bias(F.linear, 2), "conv1d": _no_bias(F.conv1d, 2),
    "conv2d": _no_bias(F.conv2d, 2), "conv3d": _no_bias(F.conv3d, 2),
    "convolution": _no_bias(torch.convolution, 2), "addmm": lambda b, x, y, **k: x @ y,
    "baddbmm": lambda b, x, y, **k: torch.bmm(x, y), "einsum": torch.einsum,
    "scaled_dot_product_attention": _sdpa_scores}
_MODULES = ((nn.LayerNorm, "layer_norm"), (nn.GroupNorm, "group_norm"),
            (INSTANCE_NORM_BASE, "instance_norm"),
            (nn.RMSNorm, "rms_norm"), (nn.Linear, "linear_module"),
            (CONV_BASE, "conv_module"))


def inner_peak(node: fx.Node, root: nn.Module, args: tuple, kwargs: dict) -> Optional[Peak]:
    """The largest number ``node`` computes inside on these input values, and its name;
    None for an op that computes nothing past its inputs and output."""
    kind = op_name(node, root)
    module = root.get_submodule(str(node.target)) if node.op == "call_module" else None
    try:
        if kind in _NORMS:
            return _norm(module, args, kwargs, kind)
        if kind in _STATS:
            return _statistic(args, kwargs, kind)
        if kind == "linear_module" and args and isinstance(args[0], torch.Tensor):
            return _dot(F.linear, (args[0], module.weight), {})  # type: ignore[union-attr]
        if kind == "conv_module" and args and isinstance(args[0], torch.Tensor) and \
                not isinstance(module, CONV_TRANSPOSE_BASE):
            return _dot(lambda x, w: _conv_module(module)(x),  # type: ignore[arg-type]
                        (args[0], module.weight), {})  # type: ignore[union-attr]
        if kind == "einsum" and args and isinstance(args[0], str):
            return _dot(lambda *a: torch.einsum(args[0], *a[1:]), args, {})
        if kind in _MATMULS:
            return _dot(_MATMULS[kind], args, kwargs)
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
        return None  # a call whose inner numbers cannot be told: judged by its output
    return None


def _layer_norm_eps(module: Optional[nn.Module], args: tuple, kwargs: dict) -> Optional[float]:
    if module is not None:
        return float(module.eps)  # type: ignore[union-attr, arg-type]
    eps = _arg(args, kwargs, 4, "eps", 1e-5)
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def row_spread(node: fx.Node, root: nn.Module, args: tuple, kwargs: dict) -> Optional[Spread]:
    """For a LayerNorm (module or function) on these input values: each normalised row's
    spread ``max(sqrt(var + eps), max |x - mean|)`` (what its output is scaled by) over its
    magnitude ``max |x|``; the row with the smallest ratio, as (ratio, spread, magnitude).
    None for any other node or an all-zero input. A low dtype rounds each value by up to
    half its ``eps`` times the magnitude, so that much over the ratio reaches the output.

    Args:
        node: the node called.
        root: the graph module (a call_module node's module is looked up in it).
        args: the call's input values.
        kwargs: the call's keyword values.

    Returns:
        (ratio, spread, magnitude) of the flattest row and the norm's eps, or None.
    """
    if op_name(node, root) != "layer_norm":
        return None
    module = root.get_submodule(str(node.target)) if node.op == "call_module" else None
    found = _normalised(module, args, kwargs)
    eps = _layer_norm_eps(module, args, kwargs)
    if found is None or eps is None:
        return None
    x, n = found
    rows = x.detach().double().reshape(-1, *x.shape[x.dim() - n:]).flatten(1)
    dev = rows - rows.mean(dim=1, keepdim=True)
    spread = torch.maximum(torch.sqrt(dev.pow(2).mean(dim=1) + eps), dev.abs().amax(dim=1))
    magnitude = rows.abs().amax(dim=1)
    seen = magnitude > 0
    if not bool(seen.any()):
        return None
    ratio = torch.where(seen, spread / magnitude.clamp_min(1e-300), torch.inf)
    i = int(ratio.argmin())
    return float(ratio[i]), float(spread[i]), float(magnitude[i]), eps
