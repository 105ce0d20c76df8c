"""Audit: a check pass that changes nothing. It lists what in a model works against mixed
precision, each finding with the node, its source line, the numbers and what to do.

``fxamp.audit(model, example_inputs)`` (in ``rewriter/audit.py``, the layer above) rewrites
the model with :func:`fxamp.amp_rewrite` (so the decisions are exactly the rewrite's) and
hands the plan and the rewritten graph, whose nodes keep the source names, shapes and stack
traces, to ``audit_graph`` here, which does the reading. The front
end is the caller's choice (``frontend=``, as for amp_rewrite): on torch.export's ATen graphs
the checks read the ATen spellings (``aten.layer_norm`` / ``native_layer_norm`` / ... eps from
the op's schema, ``aten.exp``, ``aten.to.dtype`` / ``_to_copy`` casts). Nested graphs and the
eager front end's results are walked by :mod:`fxamp.passes.audit_results`; the optional
optimizer / GradScaler / batch / ONNX checks are in :mod:`fxamp.passes.audit_context`.

Finding codes (stable):

* ``dims-not-multiple-of-8`` (info): a Linear / Conv / matmul computing in fp16/bf16 whose
  GEMM dims are not multiples of 8, so tensor cores run padded or not at all. Linear:
  in_features (K) and out_features (N); the rows (batch x tokens) come from the data and are
  not checked. Conv / ConvTranspose: in and out channels per group; depthwise convs (one input
  channel per group) are skipped, they are not tensor-core GEMMs anyway. matmul / mm / bmm /
  addmm / baddbmm: the inner dim K and the output columns N from the example inputs' shapes
  (not the rows M, usually the batch). einsum and attention kernels are not checked.
* ``explicit-cast`` (warning): ``.half()``, ``.bfloat16()``, ``.to(torch.float16)``,
  ``.to(dtype=torch.bfloat16)``, ``.type(torch.float16)``, ``.type('torch.HalfTensor')`` in
  the model.
* ``binary-cross-entropy`` (error for target cuda, whose autocast refuses it; warning for
  cpu): ``F.binary_cross_entropy`` / ``nn.BCELoss`` on probabilities.
* ``exp-without-max-shift`` (warning for fp16, info for bf16): ``exp`` of a matmul / bmm /
  einsum output (through scalar mul/div, masks, additive biases, views and casts) with no
  max (or logsumexp) subtracted on the way: exp passes fp16's max 65504 past 11.09.
* ``norm-eps-underflow`` (warning) / ``norm-eps-subnormal`` (info): a norm's eps below the
  low dtype's smallest normal (``torch.finfo(dtype).tiny``, fp16 6.1e-5): "underflow" when
  the eps rounds to 0 in that dtype (fp16: below 3e-8, e.g. 1e-12), "subnormal" otherwise
  (e.g. the default 1e-5: harmless while the kernel keeps eps in fp32, as autocast's and
  fxamp's do, but fp16 export may flush it to 0). Norm modules (BatchNorm, LayerNorm,
  GroupNorm, InstanceNorm, RMSNorm), ``F.*`` / ``torch.*`` norm functions with a numeric eps
  (their default when not given), and hand-written norms adding a literal eps before a
  ``sqrt`` / ``rsqrt``.

When the rewrite refuses the model because of a banned op (binary_cross_entropy with the
numerics passes off, target cuda), ``audit`` rewrites it again with an ``fp32:<node>``
override for each banned node, so the audit still runs and reports them. Any other
``FxampError`` (untraceable model, FP16 parameters ...) propagates.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .. import oplists
from ..oplists import call_name
from . import fetch_attr
from ..errors import source_line
from ..plan import NodePrecision, Plan
from ..policy import Policy, dtype_name
from .. import runtime
from .. import ir, ops

log = logging.getLogger(__name__)

SEVERITIES = ("error", "warning", "info")
_LOW = (torch.float16, torch.bfloat16)
_LOW_NAMES = {"torch.HalfTensor": torch.float16, "torch.cuda.HalfTensor": torch.float16,
              "torch.BFloat16Tensor": torch.bfloat16, "torch.cuda.BFloat16Tensor": torch.bfloat16}


@dataclass(frozen=True)
class Finding:
    """One audit finding.

    severity: "error" | "warning" | "info". code: a short stable id. node: the source node's
    name. source: the user's source line ("" when unknown). message: what is wrong, with the
    numbers. fix: what to do.
    """

    severity: str
    code: str
    node: str
    source: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{self.severity} {self.code} {self.node}: {self.message}{where} -> {self.fix}"


def summary(findings: Sequence[Finding]) -> str:
    """``"3 findings: 1 error, 2 warnings"`` (counts that are 0 are left out)."""
    n = len(findings)
    head = f"{n} finding{'' if n == 1 else 's'}"
    parts = []
    for severity in SEVERITIES:
        count = sum(1 for f in findings if f.severity == severity)
        if count:
            plural = "s" if count != 1 and severity != "info" else ""
            parts.append(f"{count} {severity}{plural}")
    return f"{head}: {', '.join(parts)}" if parts else head


# ---------------------------------------------------------------------------------------
# graph helpers
# ---------------------------------------------------------------------------------------
def _origin(value: Any) -> Any:
    """``value`` with the casts fxamp inserted stripped off."""
    while isinstance(value, fx.Node) and ir.is_cast(value) and value.args:
        value = value.args[0]
    return value


def _shape(value: Any, gm: nn.Module) -> Optional[Tuple[int, ...]]:
    """The shape of a node's (first floating) output, from the annotate meta or the tensor."""
    value = _origin(value)
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if not isinstance(value, fx.Node):
        return None
    shape = ir.get(value).shape
    if shape is not None:
        return tuple(shape)
    if value.op == "get_attr":
        tensor = fetch_attr(gm, str(value.target))
        if isinstance(tensor, torch.Tensor):
            return tuple(tensor.shape)
    return None


def _module(node: fx.Node, gm: nn.Module) -> Optional[nn.Module]:
    """The module a node calls: its target, or the module fxamp's rewrite passes to a helper."""
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_function" and node.target in (runtime.call_with_params,
                                                       runtime.autocast_module):
        ref = node.args[0] if node.args else None
        if isinstance(ref, fx.Node) and ref.op == "get_attr":
            found = fetch_attr(gm, str(ref.target))
            return found if isinstance(found, nn.Module) else None
    return None


def _ops(node: fx.Node, gm: nn.Module) -> Tuple[str, ...]:
    """The ATen ops a node runs ((): none, or opaque)."""
    if node.op == "call_function":
        module = _module(node, gm)
        if module is not None:  # a module the rewrite calls through a runtime helper
            return tuple(oplists.MODULE_OPS.get(type(module), ()))
    if node.op not in ("call_module", "call_function", "call_method"):
        return ()
    try:
        _, ops = oplists.node_ops(node, gm)
    except Exception:  # noqa: BLE001 - an unusual target: nothing to check
        return ()
    return tuple(ops or ())


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return ops.arg(node, name, index, default)


def _finding(node: fx.Node, severity: str, code: str, message: str, fix: str) -> Finding:
    return Finding(severity, code, node.name, source_line(node), message, fix)


def _up8(n: int) -> int:
    return -(-n // 8) * 8


# ---------------------------------------------------------------------------------------
# dims not multiples of 8
# ---------------------------------------------------------------------------------------
def _gemm_dims(node: fx.Node, ops: Tuple[str, ...],
               gm: nn.Module) -> Optional[Tuple[str, List[Tuple[str, int]]]]:
    """(what, [(dim name, size)]) for a Linear / Conv / matmul node, else None."""
    if not ops:
        return None
    op = ops[0].split(".")[0]
    module = _module(node, gm)
    if op == "linear":
        weight = module.weight if module is not None else _arg(node, 1, "weight")
        shape = _shape(weight, gm)
        if shape is None or len(shape) != 2:
            return None
        return "linear", [("in_features", shape[1]), ("out_features", shape[0])]
    if op in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d"):
        transposed = "transpose" in op
        if module is not None:
            weight, groups = module.weight, getattr(module, "groups", 1)
        else:
            weight, groups = _arg(node, 1, "weight"), _arg(node, 6, "groups", 1)
        shape = _shape(weight, gm)
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
        a = _shape(_arg(node, first, "mat1" if first else "input"), gm)
        b = _shape(_arg(node, first + 1, "mat2" if first else "other"), gm)
        if a is None or b is None or not a or not b:
            return None
        dims = [("inner dim K", a[-1])]
        if len(b) >= 2:
            dims.append(("output columns N", b[-1]))
        return "matmul", dims
    return None


def _check_dims(node: fx.Node, p: NodePrecision, ops: Tuple[str, ...],
                gm: nn.Module) -> Optional[Finding]:
    if p.dtype not in _LOW:
        return None
    found = _gemm_dims(node, ops, gm)
    if found is None:
        return None
    kind, dims = found
    bad = [(name, size) for name, size in dims if size % 8]
    if not bad:
        return None
    listed = ", ".join(f"{name}={size}" for name, size in bad)
    shapes = " (shapes of the example inputs)" if kind == "matmul" else ""
    pads = ", ".join(f"{name} {size} -> {_up8(size)}" for name, size in bad)
    return _finding(
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
        return value if value in _LOW else None
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
    name = call_name(node)
    if node.op == "call_function" and oplists.is_aten(node.target):
        return _aten_cast(node, name)
    if node.op == "call_function" and node.target not in (torch.Tensor.half,
                                                          torch.Tensor.bfloat16,
                                                          torch.Tensor.to, torch.Tensor.type):
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
        dtype = value if isinstance(value, torch.dtype) and value in _LOW else None
        if dtype is not None:
            return f"aten.{oplists.aten_name(node.target)}({dtype})", dtype  # type: ignore
    return None


def _check_cast(node: fx.Node) -> Optional[Finding]:
    found = _explicit_cast(node)
    if found is None:
        return None
    written, dtype = found
    return _finding(
        node, "warning", "explicit-cast",
        f"{written} casts to {dtype_name(dtype)} by hand: it pins this value's precision "
        "whatever the policy says",
        "remove it and let fxamp decide each op's precision (pin a node with a policy "
        f"override such as 'fp16:{node.name}' if it must stay low)")


# ---------------------------------------------------------------------------------------
# binary_cross_entropy
# ---------------------------------------------------------------------------------------
def _is_bce(ops: Tuple[str, ...]) -> bool:
    return bool(ops) and ops[0] == "binary_cross_entropy"


def _check_bce(node: fx.Node, ops: Tuple[str, ...], policy: Policy,
               label: str) -> Optional[Finding]:
    if not _is_bce(ops):
        return None
    refused = oplists.aten_category("binary_cross_entropy", policy.target) == oplists.BANNED
    why = (f"torch.autocast('{policy.target}') refuses it as unsafe in low precision"
           if refused else "its input probabilities come out of a low-precision sigmoid, "
           "which saturates to exactly 0 or 1 (log(0) = -inf)")
    return _finding(
        node, "error" if refused else "warning", "binary-cross-entropy",
        f"{label or 'binary_cross_entropy'} takes probabilities: {why}",
        "return logits and use F.binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss "
        "(drop the sigmoid)")


# ---------------------------------------------------------------------------------------
# exp without max shift
# ---------------------------------------------------------------------------------------
_MATMULS = {"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum"}
_SCALES = {"mul", "__mul__", "__rmul__", "truediv", "__truediv__", "div", "true_divide",
           "divide", "multiply"}
_TRANSPARENT = {"float", "to", "_to_copy", "alias", "expand", "type", "type_as", "contiguous",
                "view", "reshape",
                "transpose", "permute", "masked_fill", "clone", "squeeze", "unsqueeze",
                "flatten", "neg", "__neg__"}
_ADDS = {"add", "__add__", "__radd__"}
_SUBS = {"sub", "__sub__", "subtract"}
_MAXES = {"amax", "max", "logsumexp"}
_MAX_WRAPPERS = {"getitem", "getattr", "detach", "unsqueeze", "view", "reshape", "expand",
                 "expand_as", "to", "_to_copy", "float", "type_as", "contiguous"}


def _is_exp(node: fx.Node) -> bool:
    if node.op == "call_function" and oplists.is_aten(node.target):
        return oplists.aten_name(node.target) == "exp"  # torch.export graphs
    return (node.op == "call_function" and node.target is torch.exp) or \
        (node.op == "call_method" and node.target == "exp")


def _is_call(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method")


def _is_tensor_operand(value: Any) -> bool:
    value = _origin(value)
    if not isinstance(value, fx.Node):
        return False
    shape = ir.get(value).shape
    return shape is not None and len(shape) > 0


def _from_max(value: Any) -> bool:
    """Whether ``value`` is a max / amax / logsumexp (through views, getitem, detach)."""
    for _ in range(16):
        value = _origin(value)
        if not _is_call(value):
            return False
        name = call_name(value)
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
        value = _origin(stack.pop())
        if not _is_call(value) or value in seen:
            continue
        seen.add(value)
        ops = _ops(value, gm)
        if ops and ops[0] in _MATMULS and (ops[0] != "einsum" or "bmm" in ops):
            return value  # (an einsum that contracts nothing is elementwise)
        name = call_name(value)
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


def _check_exp(node: fx.Node, gm: nn.Module, policy: Policy) -> Optional[Finding]:
    if not _is_exp(node) or not node.args:
        return None
    source = _unshifted_matmul(node.args[0], gm)
    if source is None:
        return None
    low = policy.compute
    limit = math.log(torch.finfo(low).max)
    return _finding(
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
    nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
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


def _number(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _aten_norm_eps(node: fx.Node) -> Optional[Tuple[str, float]]:
    """(op, eps) for an ATen norm of a torch.export graph (``aten.layer_norm``,
    ``native_layer_norm``, ``group_norm`` / ``native_group_norm``, ``batch_norm`` /
    ``_native_batch_norm_legit*``, ``instance_norm``, ``rms_norm`` ...): any op whose name
    has "norm" and whose schema has an ``eps`` / ``epsilon`` argument (its default when not
    given)."""
    name = oplists.aten_name(node.target)  # type: ignore[arg-type]
    if "norm" not in name.split(".")[0]:
        return None
    schema = node.target._schema  # type: ignore[union-attr]
    for index, argument in enumerate(schema.arguments):
        if argument.name in ("eps", "epsilon"):
            eps = _number(_arg(node, index, argument.name, argument.default_value))
            return (f"aten.{name}", eps) if eps is not None else None
    return None


def _norm_eps(node: fx.Node, gm: nn.Module) -> Optional[Tuple[str, float]]:
    """(what, eps) for a norm module / function / hand-written norm, else None."""
    module = _module(node, gm)
    if module is not None:
        return module_eps(module)
    if node.op == "call_function" and oplists.is_aten(node.target):
        found = _aten_norm_eps(node)
        if found is not None:
            return found
    elif node.op == "call_function":
        try:
            spec = _NORM_FUNCTIONS.get(node.target)  # type: ignore[arg-type]
        except TypeError:
            spec = None
        if spec is not None:
            eps = _number(_arg(node, spec[0], "eps", spec[1]))
            label = oplists.callable_label(node.target)
            return (label, eps) if eps is not None else None
    if _is_call(node) and call_name(node) in _ADDS and len(node.args) >= 2:
        literal = [_number(a) for a in node.args[:2] if _number(a) is not None]
        feeds_root = any(_is_call(u) and call_name(u) in _ROOTS for u in node.users)
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
        eps = _number(getattr(module, "eps", None))
        return (f"nn.{type(module).__name__}", eps) if eps is not None else None
    return None


def _check_eps(node: fx.Node, gm: nn.Module, policy: Policy) -> Optional[Finding]:
    found = _norm_eps(node, gm)
    if found is None:
        return None
    return eps_finding(node.name, source_line(node), found[0], found[1], policy)


# ---------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------
def audit_graph(gm: fx.GraphModule, plan: Plan, policy: Policy) -> List[Finding]:
    """The findings of a graph rewritten by fxamp (or traced and annotated), in graph order.

    ``plan`` gives each source node's precision (``plan_of(gm)``); nodes fxamp inserted
    (casts) are skipped. Shapes come from the annotate meta, or from the tensors themselves.
    """
    findings: List[Finding] = []
    for node in gm.graph.nodes:
        if ir.is_cast(node) or node.op in ("placeholder", "output", "get_attr"):
            continue
        p = plan.nodes.get(node.name)
        ops = _ops(node, gm)
        checks: Iterable[Optional[Finding]] = (
            _check_dims(node, p, ops, gm) if p is not None else None,
            _check_cast(node),
            _check_bce(node, ops, policy, p.op if p is not None else ""),
            _check_exp(node, gm, policy),
            _check_eps(node, gm, policy),
        )
        findings.extend(f for f in checks if f is not None)
    log.debug("audit: %d findings", len(findings))
    return findings
