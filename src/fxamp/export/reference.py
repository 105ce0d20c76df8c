"""The FP32 reference an exported file is checked against, and the true-FP16 error measure.

:func:`fp32_reference` runs a model made by ``amp_rewrite`` with every low-precision cast
made an FP32 one (an FP16 weight cast gives the FP32 master, an ``x.to(float16)`` gives
``x`` in FP32): what the source model computes in FP32, with no FP16 kernel needed
(PyTorch on CPU has none for some ops, e.g. oneDNN's LSTM on CPUs without FP16 support).
A cast the model itself wrote (``x.half()``) is widened too, and an attention mask's fill
that a deployment plan writes as FP16's lowest (``passes/mask_fill.py``) has the model's
own value back.

:func:`relative_error` is the measure of the true-FP16 check: the largest
``|file - fp32|`` of an output divided by that output's largest ``|fp32|`` (its scale).
"""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
import torch.fx as fx
from .._torch import tree_leaves, tree_map

from ..op_args import fp32_values
from ..graph_run import GraphRun
from ..ops import OP_NODES
from ..result import has_result
from ..runtime import autocast_module
from ..weight_cache import is_cast_node

_LOW = (torch.float16, torch.bfloat16)
_CALLS = OP_NODES

#: the true-FP16 check's tolerance: an output may differ from FP32 by this much of its scale
#: (its largest |value|); FP16 rounding of a sound plan gives ~1e-3, a wrong file ~1
TRUE_FP16_RTOL = 0.05


def _widen(value: Any) -> Any:
    """``value`` with low dtypes and low-precision tensors made FP32, through plain tuples,
    lists and dicts (fx's immutable ones become ordinary ones)."""
    if isinstance(value, torch.dtype) and value in _LOW:
        return torch.float32
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, dict):
        return {k: _widen(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_widen(v) for v in value]
    if type(value) is tuple:
        return tuple(_widen(v) for v in value)
    return tree_map(_widen_leaf, value)


def _widen_leaf(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in _LOW else value


class _Fp32Run(GraphRun):
    """A rewritten graph run with its low-precision casts made FP32."""

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in _CALLS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if is_cast_node(n):  # an FP16 copy of an FP32 master weight: the master
            return args[0]
        # the model's own values where the graph holds others (a mask fill written as fp16's
        # lowest, a dtype read at run time that follows autocast)
        args, kwargs = fp32_values(n, _widen(args), _widen(kwargs))
        if n.op == "call_module":
            sub = self.fetch_attr(str(n.target))
            if isinstance(sub, fx.GraphModule) and has_result(sub):
                return _widen(_Fp32Run(sub).run(*args, **kwargs))
        if n.op == "call_function":  # (a call autocast decides inside: run in FP32, with
            if n.target is autocast_module:  # no FP16 kernel needed)
                return _widen(args[0](*args[2:], **kwargs))
            wrapped = getattr(n.target, "fxamp_wrapped", None)
            if wrapped is not None:
                return _widen(wrapped(*args, **kwargs))
        return _widen(getattr(self, n.op)(n.target, args, kwargs))


def fp32_reference(model: torch.nn.Module) -> Callable[..., Any]:
    """A callable computing ``model``'s outputs in FP32: a graph made by ``amp_rewrite`` is
    run with its casts widened (see the module doc), any other module as it is."""
    if not isinstance(model, fx.GraphModule):
        return model

    def run(*inputs: Any) -> Any:
        with torch.no_grad(), torch.autocast("cpu", enabled=False), \
                torch.autocast("cuda", enabled=False):
            return _Fp32Run(model).run(*inputs)
    return run


def relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want| (the output's scale; inf where ``got`` is inf/NaN and
    ``want`` is finite, nan when the shapes differ)."""
    return relative_of(*error_parts(got, want))


def relative_of(diff: float, scale: float) -> float:
    """``diff / scale`` of :func:`error_parts`' pair: nan, 0 and inf as they are."""
    if diff != diff or diff in (0.0, float("inf")):
        return diff
    return diff / max(scale, 1e-12)


def error_parts(got: Any, want: Any) -> Tuple[float, float]:
    """(max |got - want|, max |want|) over the positions where ``want`` is finite: inf for
    the first where ``got`` is inf/NaN there, nan when the shapes differ; (0, 0) for an
    empty output.

    Args:
        got: the file's output (an array or tensor).
        want: the FP32 output.

    Returns:
        The largest difference and the output's scale.
    """
    g = torch.as_tensor(got).double()
    w = want.detach().double().cpu() if isinstance(want, torch.Tensor) else \
        torch.as_tensor(want).double()
    if tuple(g.shape) != tuple(w.shape):
        return float("nan"), 0.0
    if not w.numel():
        return 0.0, 0.0
    finite = torch.isfinite(w)
    every = bool(finite.all())  # (no copies through a mask where every value is finite)
    g_f, w_f = (g, w) if every else (g[finite], w[finite])
    scale = float(w_f.abs().max()) if w_f.numel() else 0.0
    if not bool(torch.isfinite(g_f).all()):
        return float("inf"), scale
    diff = float((g_f - w_f).abs().max()) if w_f.numel() else 0.0
    return diff, scale


def tensor_outputs(value: Any) -> List[torch.Tensor]:
    """The tensors of a model's (nested) output, in order."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
