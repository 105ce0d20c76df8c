"""The audit's checks of single ops: ``dims-not-multiple-of-8`` (Linear / Conv / matmul GEMM
dims), ``explicit-cast`` (``.half()``, ``.to(torch.float16)``, ``aten._to_copy``...) and
``binary-cross-entropy``. The finding codes are described in :mod:`fxamp.passes.audit`.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ... import ir, ops
from ...plan import NodePrecision
from ...policy import Policy, dtype_name
from .findings import LOW, Finding, arg, called_module, finding, shape_of, up8

_LOW_NAMES = {"torch.HalfTensor": torch.float16, "torch.cuda.HalfTensor": torch.float16,
              "torch.BFloat16Tensor": torch.bfloat16, "torch.cuda.BFloat16Tensor": torch.bfloat16}
#: the tensor methods that cast, as an fx graph calls them as functions
_CAST_METHODS = (torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.to, torch.Tensor.type)


# ---------------------------------------------------------------------------------------
# dims not multiples of 8
# ---------------------------------------------------------------------------------------
def _gemm_dims(node: fx.Node, names: Tuple[str, ...],
               gm: nn.Module) -> Optional[Tuple[str, List[Tuple[str, int]]]]:
    """(what, [(dim name, size)]) for a Linear / Conv / matmul node, else None."""
    if not names:
        return None
    op = names[0].split(".")[0]
    module = called_module(node, gm)
    if op == "linear":
        weight = module.weight if module is not None else arg(node, 1, "weight")
        shape = shape_of(weight, gm)
        if shape is None or len(shape) != 2:
            return None
        return "linear", [("in_features", shape[1]), ("out_features", shape[0])]
    if op in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d"):
        transposed = "transpose" in op
        if module is not None:
            weight, groups = module.weight, getattr(module, "groups", 1)
        else:
            weight, groups = arg(node, 1, "weight"), arg(node, 6, "groups", 1)
        shape = shape_of(weight, gm)
        if shape is None or len(shape) < 3 or not isinstance(groups, int) or groups < 1:
            return None
        if transposed:  # weight (C_in, C_out / groups, *k)
            c_in_group, c_out_group = shape[0] // groups, shape[1]
        else:  # weight (C_out, C_in / groups, *k)
            c_in_group, c_out_group = shape[1], shape[0] // groups
        if groups > 1 and c_in_group == 1:
            return None  # depthwise: not a tensor-core GEMM
        suffix = " per group" if groups > 1 else ""
        return "conv", [(f"in_channels{suffix}", c_in_group),
                        (f"out_channels{suffix}", c_out_group)]
    if op in ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm"):
        first = 1 if op.startswith("add") or op == "baddbmm" else 0
        a = shape_of(arg(node, first, "mat1" if first else "input"), gm)
        b = shape_of(arg(node, first + 1, "mat2" if first else "other"), gm)
        if a is None or b is None or not a or not b:
            return None
        dims = [("inner dim K", a[-1])]
        if len(b) >= 2:
            dims.append(("output columns N", b[-1]))
        return "matmul", dims
    return None


def check_dims(node: fx.Node, p: NodePrecision, names: Tuple[str, ...],
               gm: nn.Module) -> Optional[Finding]:
    """``dims-not-multiple-of-8`` for a GEMM node (``names``: its ATen op names)."""
    if p.dtype not in LOW:
        return None
    found = _gemm_dims(node, names, gm)
    if found is None:
        return None
    kind, dims = found
    bad = [(name, size) for name, size in dims if size % 8]
    if not bad:
        return None
    listed = ", ".join(f"{name}={size}" for name, size in bad)
    shapes = " (shapes of the example inputs)" if kind == "matmul" else ""
    pads = ", ".join(f"{name} {size} -> {up8(size)}" for name, size in bad)
    return finding(
        node, "info", "dims-not-multiple-of-8",
        f"{p.op or kind} computes in {dtype_name(p.dtype)} with {listed}{shapes}: not a "
        f"multiple of 8, so tensor cores run padded or idle",
        f"if this layer is hot, pad to multiples of 8 ({pads}); a small "
        "layer (an image stem, a classifier head) costs little as it is")


# ---------------------------------------------------------------------------------------
# explicit low-precision casts
# ---------------------------------------------------------------------------------------
def _low_dtype_of(value: Any) -> Optional[torch.dtype]:
    if isinstance(value, torch.dtype):
        return value if value in LOW else None
    if isinstance(value, str):
        return _LOW_NAMES.get(value)
    if isinstance(value, type):
        return {torch.HalfTensor: torch.float16,
                torch.BFloat16Tensor: torch.bfloat16}.get(value)  # type: ignore[arg-type]
    return None


def _explicit_cast(node: fx.Node) -> Optional[Tuple[str, torch.dtype]]:
    """(how it is written, dtype) when ``node`` casts to fp16/bf16 by hand."""
    if ir.is_cast(node):
        return None
    name = ops.name(node)
    if ops.is_aten(node):
        return _aten_cast(node, name)
    if node.op == "call_function" and not ops.is_call(node, _CAST_METHODS):
        return None
    if node.op not in ("call_method", "call_function"):
        return None
    if name == "half":
        return ".half()", torch.float16
    if name == "bfloat16":
        return ".bfloat16()", torch.bfloat16
    if name in ("to", "type"):
        for i, value in enumerate(list(node.args[1:]) + list(node.kwargs.values())):
            dtype = _low_dtype_of(value)
            if dtype is not None:
                shown = repr(value) if isinstance(value, str) else str(value)
                if i >= len(node.args) - 1:
                    key = next(k for k, v in node.kwargs.items() if v is value)
                    shown = f"{key}={shown}"
                return f".{name}({shown})", dtype
    return None


def _aten_cast(node: fx.Node, name: str) -> Optional[Tuple[str, torch.dtype]]:
    """``aten.to.dtype`` / ``aten._to_copy`` (torch.export's spelling of ``.half()``,
    ``.to(torch.float16)``) to fp16/bf16: (how it reads, dtype)."""
    if name not in ("to", "_to_copy"):
        return None
    for value in list(node.args[1:]) + list(node.kwargs.values()):
        dtype = value if isinstance(value, torch.dtype) and value in LOW else None
        if dtype is not None:
            return f"aten.{ops.aten_name(node)}({dtype})", dtype
    return None


def check_cast(node: fx.Node) -> Optional[Finding]:
    """``explicit-cast`` for a hand-written cast to fp16/bf16."""
    found = _explicit_cast(node)
    if found is None:
        return None
    written, dtype = found
    return finding(
        node, "warning", "explicit-cast",
        f"{written} casts to {dtype_name(dtype)} by hand: it pins this value's precision "
        "whatever the policy says",
        "remove it and let fxamp decide each op's precision (pin a node with a policy "
        f"override such as 'fp16:{node.name}' if it must stay low)")


# ---------------------------------------------------------------------------------------
# binary_cross_entropy
# ---------------------------------------------------------------------------------------
def _is_bce(names: Tuple[str, ...]) -> bool:
    return bool(names) and names[0] == "binary_cross_entropy"


def check_bce(node: fx.Node, names: Tuple[str, ...], policy: Policy,
              label: str) -> Optional[Finding]:
    """``binary-cross-entropy`` for a node running it (``names``: its ATen op names)."""
    if not _is_bce(names):
        return None
    refused = ops.aten_category("binary_cross_entropy", policy.target) == ops.BANNED
    why = (f"torch.autocast('{policy.target}') refuses it as unsafe in low precision"
           if refused else "its input probabilities come out of a low-precision sigmoid, "
           "which saturates to exactly 0 or 1 (log(0) = -inf)")
    return finding(
        node, "error" if refused else "warning", "binary-cross-entropy",
        f"{label or 'binary_cross_entropy'} takes probabilities: {why}",
        "return logits and use F.binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss "
        "(drop the sigmoid)")
