"""Placement's allowlist: which "follow" ops may move across the low/FP32 boundary.

Free are only follow ops known to behave the same in either dtype: data movement and
selection ops that commute with rounding (view, permute, slicing, repeat, relu, max pooling,
nearest upsampling, zero padding) move either way (:data:`EXACT`); arithmetic follow ops
(add, mul, gelu, average pooling ...) only from the low dtype to FP32 (:data:`ARITH`). The
op is matched through :mod:`fxamp.ops` (fx functions, tensor methods, modules).

Exact in the forward is not exact in the backward for the ops whose backward sums the
gradients of several outputs into one input element (:func:`sums_gradients`): a gather with
a tensor index (repeated indices), ``expand``, ``repeat``, nearest upsampling, max pooling
with overlapping windows. Autocast sums those gradients in the dtype the op runs in; moved
across a cast, the sum would be rounded in the other dtype. The cut model leaves them where
autocast runs them when their value needs a gradient.
"""
from __future__ import annotations

import operator
from typing import List, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ... import ops

#: commute with rounding: the same result whichever side of them the cast is
_EXACT_METHODS = {"view", "reshape", "flatten", "permute", "transpose", "t", "contiguous",
                  "expand", "repeat", "squeeze", "unsqueeze", "narrow", "select", "flip",
                  "roll", "clone", "relu", "movedim", "__getitem__", "__neg__", "neg", "abs"}
_EXACT_FUNCTIONS = {torch.flatten, torch.reshape, torch.permute, torch.transpose,
                    torch.squeeze, torch.unsqueeze, torch.narrow, torch.select, torch.flip,
                    torch.roll, torch.clone, torch.movedim, torch.relu, F.relu, F.relu6,
                    operator.getitem, operator.neg, torch.neg, torch.abs, F.max_pool1d,
                    F.max_pool2d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
                    F.pixel_shuffle, F.pixel_unshuffle, F.interpolate, F.pad}
_EXACT_MODULES = (nn.ReLU, nn.ReLU6, nn.MaxPool1d, nn.MaxPool2d, nn.AdaptiveMaxPool1d,
                  nn.AdaptiveMaxPool2d, nn.Flatten, nn.Unflatten, nn.Identity, nn.Upsample,
                  nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d,
                  nn.PixelShuffle, nn.PixelUnshuffle)
#: arithmetic: rounding before them differs from rounding after, so they only move to FP32
_ARITH_METHODS = {"add", "sub", "mul", "__add__", "__sub__", "__mul__", "__radd__",
                  "__rmul__", "mean", "sigmoid", "tanh"}
_ARITH_FUNCTIONS = {operator.add, operator.sub, operator.mul, torch.add, torch.sub, torch.mul,
                    torch.mean, torch.sigmoid, torch.tanh, F.gelu, F.silu, F.hardswish,
                    F.hardsigmoid, F.leaky_relu, F.avg_pool1d, F.avg_pool2d,
                    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d}
_ARITH_MODULES = (nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid,
                  nn.LeakyReLU, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
                  nn.AdaptiveAvgPool2d)
#: exact ops whose backward sums gradients (see :func:`sums_gradients`)
_SUMMING_METHODS = {"expand", "repeat"}
_SUMMING_FUNCTIONS = {F.interpolate}
_SUMMING_MODULES = (nn.Upsample, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d)
_MAX_POOLS = (F.max_pool1d, F.max_pool2d)
_ADAPTIVE_MAX_POOLS = (F.adaptive_max_pool1d, F.adaptive_max_pool2d)
#: consumers that read only a value's shape (its dtype may change under them)
_SHAPE_ATTRS = {"shape", "ndim", "device"}
_SHAPE_METHODS = {"size", "dim", "numel", "ndimension"}

EXACT, ARITH = "exact", "arith"


def free_kind(node: fx.Node, root: nn.Module) -> Optional[str]:
    """EXACT or ARITH for an allowlisted call whose arguments keep it dtype-agnostic."""
    args, kwargs = node.args, node.kwargs
    module = ops.module_of(node, root)
    if module is not None:
        cls = type(module)
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            return None
        if getattr(module, "inplace", False) or getattr(module, "return_indices", False):
            return None
        if cls is nn.Upsample and module.mode not in ("nearest", "nearest-exact"):
            return None
        if cls in (nn.ConstantPad1d, nn.ConstantPad2d) and module.value != 0:
            return None
        if cls in _EXACT_MODULES:
            return EXACT
        return ARITH if cls in _ARITH_MODULES else None
    if node.op in ("call_method", "call_function"):
        kind = (EXACT if ops.is_call(node, _EXACT_FUNCTIONS, _EXACT_METHODS) else
                ARITH if ops.is_call(node, _ARITH_FUNCTIONS, _ARITH_METHODS) else None)
        if ops.is_call(node, (F.interpolate,)):
            mode = ops.arg(node, "mode", 3, "nearest")
            if mode not in ("nearest", "nearest-exact"):
                return None
        if ops.is_call(node, (F.pad,)):
            mode = ops.arg(node, "mode", 2, "constant")
            value = ops.arg(node, "value", 3)
            if mode != "constant" or value not in (None, 0, 0.0):
                return None
    else:
        return None
    if kind is None or kwargs.get("inplace") or kwargs.get("return_indices") \
            or kwargs.get("out") is not None:
        return None
    if any(a is True for a in args[1:]):  # positional inplace / return_indices / ...
        return None
    if "dtype" in kwargs or any(isinstance(a, torch.dtype) for a in _flat(args)):
        return None
    return kind


def sums_gradients(node: fx.Node, root: nn.Module) -> bool:
    """Whether the backward of the exact op ``node`` may sum several gradients into one
    element of its input: a gather (``x[index]`` with a tensor index, which may repeat rows),
    a broadcast (``expand``), ``repeat``, nearest upsampling, max pooling whose windows
    overlap (adaptive max pooling: taken to). The sum is rounded in the dtype the op runs in,
    so such an op gives the gradients autocast gives only in autocast's dtype."""
    module = ops.module_of(node, root)
    if module is not None:
        if isinstance(module, _SUMMING_MODULES):
            return True
        if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d)):
            return _windows_overlap(module.kernel_size, module.stride, module.dilation)
        return False
    if ops.is_call(node, _SUMMING_FUNCTIONS, _SUMMING_METHODS) \
            or ops.is_call(node, _ADAPTIVE_MAX_POOLS):
        return True
    for pool in _MAX_POOLS:
        if ops.is_call(node, (pool,)):
            kernel = ops.arg(node, "kernel_size", 1)
            return _windows_overlap(kernel, ops.arg(node, "stride", 2) or kernel,
                                    ops.arg(node, "dilation", 4, 1))
    if ops.is_call(node, (operator.getitem,), ("__getitem__",)):
        return _tensor_index(node.args[1] if len(node.args) > 1 else None)
    return False


def _windows_overlap(kernel: object, stride: object, dilation: object) -> bool:
    """Whether pooling windows of this size, stride and dilation share input elements (any
    argument not a plain int or tuple of ints counts as overlapping)."""
    sizes = [kernel, stride, dilation]
    if not all(isinstance(v, int) or (isinstance(v, (tuple, list)) and
                                      all(isinstance(e, int) for e in v)) for v in sizes):
        return True
    dims = max(len(v) if isinstance(v, (tuple, list)) else 1 for v in sizes)
    k, s, d = ([v] * dims if isinstance(v, int) else list(v) for v in sizes)
    return any(si < (ki - 1) * di + 1 for ki, si, di in zip(k, s, d))


def _tensor_index(index: object) -> bool:
    """Whether an index may hold a tensor (advanced indexing, a gather): a node or a list
    outside a ``slice`` (slice bounds are ints)."""
    if isinstance(index, fx.Node) or isinstance(index, list):
        return True
    if isinstance(index, tuple):
        return any(_tensor_index(i) for i in index)
    return False


def _flat(value: object) -> List[object]:
    out: List[object] = []
    fx.node.map_aggregate(value, out.append)
    return out


def shape_only(user: fx.Node) -> bool:
    """A consumer that reads only the shape/device of its input."""
    if ops.is_call(user, (getattr,)):
        return len(user.args) > 1 and user.args[1] in _SHAPE_ATTRS
    return ops.is_call(user, (), _SHAPE_METHODS)
