"""The audit's numerics checks: ``exp-without-max-shift`` (exp of matmul scores with no row
max subtracted) and ``norm-eps-underflow`` / ``norm-eps-subnormal`` (a norm's eps below the
low dtype's smallest normal). The finding codes are described in :mod:`fxamp.passes.audit`.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ... import ir, ops
from ..._torch import BATCH_NORM_BASE, INSTANCE_NORM_BASE
from ...errors import source_line
from ...policy import Policy, dtype_name
from .findings import (Finding, arg, called_module, finding, is_call_node, number,
                             op_names, origin)

# ---------------------------------------------------------------------------------------
# exp without max shift
# ---------------------------------------------------------------------------------------
_MATMULS = {"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum"}
#: op names as ``ops.name`` gives them (fx functions, tensor methods, dunders, ATen alike)
_SCALES = {"mul", "rmul", "truediv", "div", "true_divide", "divide", "multiply"}
_TRANSPARENT = {"float", "to", "_to_copy", "alias", "expand", "type", "type_as", "contiguous",
                "view", "reshape",
                "transpose", "permute", "masked_fill", "clone", "squeeze", "unsqueeze",
                "flatten", "neg"}
_ADDS = {"add", "radd"}
_SUBS = {"sub", "subtract"}
_MAXES = {"amax", "max", "logsumexp"}
_MAX_WRAPPERS = {"getitem", "getattr", "detach", "unsqueeze", "view", "reshape", "expand",
                 "expand_as", "to", "_to_copy", "float", "type_as", "contiguous"}


def _is_exp(node: fx.Node) -> bool:
    if ops.is_aten(node):
        return ops.aten_name(node) == "exp"  # torch.export graphs
    return ops.is_call(node, (torch.exp,), ("exp",))


def _is_tensor_operand(value: Any) -> bool:
    value = origin(value)
    if not isinstance(value, fx.Node):
        return False
    shape = ir.get(value).shape
    return shape is not None and len(shape) > 0


def _from_max(value: Any) -> bool:
    """Whether ``value`` is a max / amax / logsumexp (through views, getitem, detach)."""
    for _ in range(16):
        value = origin(value)
        if not is_call_node(value):
            return False
        name = ops.name(value)
        if name in _MAXES:
            return True
        if name not in _MAX_WRAPPERS or not value.args:
            return False
        value = value.args[0]
    return False


def _unshifted_matmul(start: Any, gm: nn.Module) -> Optional[fx.Node]:
    """The matmul feeding ``start`` with no max subtracted on the way, if any."""
    stack: List[Any] = [start]
    seen: Set[fx.Node] = set()
    while stack:
        value = origin(stack.pop())
        if not is_call_node(value) or value in seen:
            continue
        seen.add(value)
        names = op_names(value, gm)
        if names and names[0] in _MATMULS and (names[0] != "einsum" or "bmm" in names):
            return value  # (an einsum that contracts nothing is elementwise)
        name = ops.name(value)
        args = [a for a in value.args if isinstance(a, fx.Node)]
        if name in _SUBS:
            if len(value.args) > 1 and _from_max(value.args[1]):
                continue  # shifted
            stack.extend(args[:1])
        elif name in _SCALES:
            tensors = [a for a in value.args[:2] if _is_tensor_operand(a)]
            if len(tensors) == 1:
                stack.append(tensors[0])
        elif name in _ADDS:
            stack.extend(a for a in value.args[:2] if isinstance(a, fx.Node))
        elif name in _TRANSPARENT and value.args:
            stack.append(value.args[0])
    return None


def check_exp(node: fx.Node, gm: nn.Module, policy: Policy) -> Optional[Finding]:
    """``exp-without-max-shift`` for an exp of unshifted matmul scores."""
    if not _is_exp(node) or not node.args:
        return None
    source = _unshifted_matmul(node.args[0], gm)
    if source is None:
        return None
    low = policy.compute
    limit = math.log(torch.finfo(low).max)
    return finding(
        node, "warning" if low == torch.float16 else "info", "exp-without-max-shift",
        f"exp of scores from {source.name} with no row max subtracted: exp passes "
        f"{dtype_name(low)}'s max {torch.finfo(low).max:.6g} once a score passes "
        f"{limit:.2f} (inf, then NaN after the normalisation)",
        "use F.softmax(scores, dim=-1) (fxamp keeps it in FP32), or subtract "
        "scores.amax(dim=-1, keepdim=True) before exp")


# ---------------------------------------------------------------------------------------
# norm eps
# ---------------------------------------------------------------------------------------
_NORM_MODULES: Tuple[type, ...] = (
    BATCH_NORM_BASE, nn.LayerNorm, nn.GroupNorm,
    INSTANCE_NORM_BASE) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
#: norm function -> (positional index of eps, its default)
_NORM_FUNCTIONS = {F.layer_norm: (4, 1e-5), F.group_norm: (4, 1e-5), F.batch_norm: (7, 1e-5),
                   F.instance_norm: (7, 1e-5), torch.layer_norm: (4, 1e-5),
                   torch.group_norm: (4, 1e-5), torch.batch_norm: (7, 1e-5),
                   torch.instance_norm: (7, 1e-5)}
if hasattr(F, "rms_norm"):
    _NORM_FUNCTIONS[F.rms_norm] = (3, None)
if hasattr(torch, "rms_norm"):
    _NORM_FUNCTIONS[torch.rms_norm] = (3, None)
_ROOTS = {"sqrt", "rsqrt"}


def _aten_norm_eps(node: fx.Node) -> Optional[Tuple[str, float]]:
    """(op, eps) for an ATen norm of a torch.export graph (``aten.layer_norm``,
    ``native_layer_norm``, ``group_norm`` / ``native_group_norm``, ``batch_norm`` /
    ``_native_batch_norm_legit*``, ``instance_norm``, ``rms_norm`` ...): any op whose name
    has "norm" and whose schema has an ``eps`` / ``epsilon`` argument (its default when not
    given)."""
    name = ops.aten_name(node)
    if "norm" not in name.split(".")[0]:
        return None
    key, value = ops.schema_arg(node, ("eps", "epsilon"))
    eps = number(value) if key is not None else None
    return (f"aten.{name}", eps) if eps is not None else None


def _norm_eps(node: fx.Node, gm: nn.Module) -> Optional[Tuple[str, float]]:
    """(what, eps) for a norm module / function / hand-written norm, else None."""
    module = called_module(node, gm)
    if module is not None:
        return module_eps(module)
    if ops.is_aten(node):
        found = _aten_norm_eps(node)
        if found is not None:
            return found
    elif ops.is_call(node, _NORM_FUNCTIONS.keys()):
        spec = _NORM_FUNCTIONS[node.target]  # type: ignore[index]
        eps = number(arg(node, spec[0], "eps", spec[1]))
        label = ops.callable_label(node.target)
        return (label, eps) if eps is not None else None
    if is_call_node(node) and ops.name(node) in _ADDS and len(node.args) >= 2:
        literal = [number(a) for a in node.args[:2] if number(a) is not None]
        feeds_root = any(is_call_node(u) and ops.name(u) in _ROOTS for u in node.users)
        if len(literal) == 1 and feeds_root:
            return "hand-written norm (x + eps before sqrt/rsqrt)", literal[0]  # type: ignore
    return None


def eps_finding(name: str, source: str, what: str, eps: float,
                policy: Policy) -> Optional[Finding]:
    """The norm-eps finding for a norm ``what`` with ``eps`` at node / module ``name``."""
    low = policy.compute
    tiny = torch.finfo(low).tiny
    if not 0 < eps < tiny:
        return None
    as_low = torch.tensor(eps, dtype=low).item()
    dt = dtype_name(low)
    if as_low == 0:
        return Finding(
            "warning", "norm-eps-underflow", name, source,
            f"{what} eps={eps:g} is below {dt}'s smallest normal {tiny:.2g} and is 0 in "
            f"{dt}: wherever eps is held in {dt} (a hand-written norm computing in {dt}, "
            f"{dt} export to ONNX/TensorRT) a constant row divides by 0 (NaN)",
            f"use eps >= {tiny:.2g} (e.g. 1e-4), or keep the norm in FP32 (policy "
            f"'fp32:{name}')")
    return Finding(
        "info", "norm-eps-subnormal", name, source,
        f"{what} eps={eps:g} is below {dt}'s smallest normal {tiny:.2g} (subnormal in "
        f"{dt})",
        f"harmless while the kernel keeps eps in FP32 (autocast, fxamp); for {dt} export "
        f"(ONNX/TensorRT), which may flush it to 0, use eps >= {tiny:.2g}")


def module_eps(module: nn.Module) -> Optional[Tuple[str, float]]:
    """(label, eps) of a norm module, else None."""
    if isinstance(module, _NORM_MODULES):
        eps = number(getattr(module, "eps", None))
        return (f"nn.{type(module).__name__}", eps) if eps is not None else None
    return None


def check_eps(node: fx.Node, gm: nn.Module, policy: Policy) -> Optional[Finding]:
    """``norm-eps-underflow`` / ``norm-eps-subnormal`` for a norm with a tiny eps."""
    found = _norm_eps(node, gm)
    if found is None:
        return None
    return eps_finding(node.name, source_line(node), found[0], found[1], policy)
