"""Norm eps pass (rule "norm_eps"): normalisations whose eps the low dtype cannot hold.

Hand-written norms (``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``,
``(x - mu) / sqrt(var + eps)``) add eps in tensor arithmetic: in fp16 an eps of 1e-12 is 0, so a
constant row gives ``0 * inf = NaN``. When eps is below the low dtype's smallest normal
(fp16: 6.1e-5) and the sum is planned in the low dtype, the statistics (the reduction and what
feeds it), the eps addition, the root and the normalising multiply/divide run in FP32.

Norm modules and ``F.*`` norm functions hand eps to a kernel as a double; most kernels
accumulate in FP32 and keep it. The pass probes the installed kernel with a constant input in
the low dtype and fences the norm in FP32 only where the result is not finite (seen:
InstanceNorm in fp16). The audit reports every tiny eps either way.

A deployment plan (``target="tensorrt"``) judges a hand-written norm on the values seen (the
example and calibration inputs, :func:`fxamp.passes.ranges.measure`): its eps is lost only
where the statistic it is added to gets small enough for the eps to count
(:func:`eps_matters`); elsewhere the statistics stay FP16, as the ONNX tools write them. A
training plan fences it whatever the inputs (a batch later in training may be constant).

A deployment plan also judges each LayerNorm by its input rows seen
(:func:`fxamp.passes.inner_values.row_spread`). A row that is nearly constant
(``3 + 1e-4 * x``) has a spread far below its magnitude. FP16 rounds each value by up to
2^-11 of the magnitude, and the norm divides by the spread, so that rounding reaches the
output. With a large eps the division is damped; with eps 1e-12 it is not, and the output is
0 or noise where FP32 gives the row's pattern. Where the low dtype's rounding exceeds
:data:`FLAT_ERROR` of a row's spread (:func:`rows_lost`), the norm and the node that makes
its input (back through views and dropout) run in FP32. The file then holds an FP32
LayerNormalization over FP32 values, which onnxruntime's CPU kernel computes right
(tests/test_export_flat_rows.py).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .. import ir, ops
from .._torch import BATCH_NORM_BASE, INSTANCE_NORM_BASE, unset_fake_temporarily
from ..ir import Decision, Rule
from ..policy import Policy, dtype_name, is_deploy
from . import fetch_attr
from .manager import PassContext
from .ranges import measure
from .inner_values import Spread
from .rule import DecisionRule, rule_pass

log = logging.getLogger(__name__)

NORM_MODULES = (nn.LayerNorm, nn.GroupNorm, BATCH_NORM_BASE, INSTANCE_NORM_BASE) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
# fx and torch.export (ATen) spellings; eps is read by name through the op's schema
NORM_FUNCTIONS = (F.layer_norm, F.group_norm, F.instance_norm, F.batch_norm,
                  getattr(F, "rms_norm", F.layer_norm),
                  torch.ops.aten.layer_norm.default, torch.ops.aten.group_norm.default,
                  torch.ops.aten.instance_norm.default, torch.ops.aten.batch_norm.default,
                  torch.ops.aten.rms_norm.default)
_REDUCTIONS = {"mean", "var", "sum", "std", "square"}
_STATS_INPUTS = {"pow", "square", "mul", "sub", "abs"}  # ops.name: dunders stripped
_ROOTS = {"rsqrt", "sqrt", "reciprocal", "pow"}
#: the largest part of a LayerNorm row's normalising spread that the low dtype's rounding of
#: the row may reach (the output is off by that much of its unit scale)
FLAT_ERROR = 2.0 ** -6



def _is_low(node: fx.Node, policy: Policy) -> bool:
    plan = ir.precision(node)
    return plan is not None and plan.dtype == policy.compute


def _eps_value(gm: fx.GraphModule, value: object) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, fx.Node) and value.op == "get_attr":
        attr = fetch_attr(gm, str(value.target))
        if isinstance(attr, torch.Tensor) and attr.numel() == 1:
            return float(attr)
    return None


def _stats_chain(node: fx.Node) -> List[fx.Node]:
    """The reduction feeding an eps addition and the elementwise ops feeding it."""
    if node.op not in ("call_function", "call_method") or ops.name(node) not in _REDUCTIONS:
        return []
    chain = [node]
    current = node
    for _ in range(3):
        src = current.args[0] if current.args else None
        if not isinstance(src, fx.Node) or ops.name(src) not in _STATS_INPUTS:
            break
        chain.append(src)
        current = src
    return chain


def _normalise_chain(add: fx.Node) -> List[fx.Node]:
    """The root of the eps sum and the multiply/divide that applies it."""
    chain: List[fx.Node] = []
    current = add
    while len(current.users) == 1:
        user = next(iter(current.users))
        name = ops.name(user)
        if name in _ROOTS:
            chain.append(user)
            current = user
            continue
        if name in ("mul", "truediv", "div"):
            chain.append(user)
        break
    return chain


def eps_matters(eps: float, smallest: float, dtype: torch.dtype) -> bool:
    """Whether adding ``eps`` to a statistic whose smallest value is ``smallest`` changes
    it by more than ``dtype``'s rounding, or the statistic itself falls under ``dtype``'s
    smallest normal (0 * inf on a constant row): then the eps is lost in ``dtype``."""
    info = torch.finfo(dtype)
    return smallest < max(info.tiny, eps / info.eps)


def rows_lost(ratio: float, dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s rounding of a row (half its eps, times the row's magnitude) is
    over :data:`FLAT_ERROR` of its normalising spread, for a row whose spread is ``ratio``
    times its magnitude (:func:`fxamp.passes.inner_values.row_spread`).

    Args:
        ratio: the row's normalising spread over its magnitude.
        dtype: the low dtype the row would be rounded to.

    Returns:
        True where the norm would scale the rounding past :data:`FLAT_ERROR` of its output.
    """
    return torch.finfo(dtype).eps / 2 > FLAT_ERROR * ratio


def _flat_rows(gm: fx.GraphModule, policy: Policy, node: fx.Node,
               spread: Optional[Dict[str, Spread]]
               ) -> Dict[fx.Node, Decision]:
    """A LayerNorm planned in the low dtype whose input rows seen are so flat that the low
    dtype's rounding of them is lost in the output (:func:`rows_lost`): the norm in fp32,
    and the node that makes its input too, so the rows reach it unrounded.

    Args:
        gm: the graph being planned.
        policy: the rewrite's policy (its low dtype).
        node: the node the rule looks at.
        spread: each LayerNorm's flattest input row seen (``PassContext.spread``), or None
            where no values were seen.

    Returns:
        The decisions, by node (empty where the rule does not apply).
    """
    seen = None if spread is None else spread.get(node.name)
    if seen is None or not _is_low(node, policy) or not rows_lost(seen[0], policy.compute):
        return {}
    ratio, width, size, eps = seen  # (measured on LayerNorms only, with their eps)
    low = dtype_name(policy.compute)
    rows = (f"rows seen are nearly constant: spread {width:.3g} on values up to {size:.3g}, "
            f"so {low}'s rounding of them is {torch.finfo(policy.compute).eps / 2 / ratio:.2g}"
            f" of their spread")
    eps_text = f" and eps={eps:g} does not damp it"
    out = {node: Decision(torch.float32, Rule.NORM_EPS,
                          f"its {rows}, which the norm scales up to its output{eps_text}: "
                          "the norm and its input in fp32")}
    feeds = Decision(torch.float32, Rule.NORM_EPS, f"feeds {node.name}, whose {rows}: made "
                     "in fp32 so the rows keep their spread")
    for src in _makers(gm, node):
        if _is_low(src, policy):  # a mover that follows its input follows it to fp32
            out[src] = feeds
    return out


_PASSES_VALUES = (nn.Dropout, nn.Identity)


def _makers(gm: fx.GraphModule, node: fx.Node, depth: int = 8) -> List[fx.Node]:
    """The node that computes ``node``'s first input and the nodes that only pass its values
    on to ``node`` (views, dropout, clone): what makes the input a LayerNorm sees.

    Args:
        gm: the graph (to tell a Dropout or Identity module).
        node: the LayerNorm.
        depth: at most this many nodes.

    Returns:
        The nodes, the nearest first.
    """
    out: List[fx.Node] = []
    src = node.args[0] if node.args else None
    while isinstance(src, fx.Node) and src.op in ("call_function", "call_method",
                                                  "call_module") and len(out) < depth:
        out.append(src)
        passes = ops.moves_values(src) or ops.name(src) in ("dropout", "alias") or (
            src.op == "call_module" and isinstance(gm.get_submodule(str(src.target)),
                                                   _PASSES_VALUES))
        if not passes:
            break
        src = src.args[0] if src.args else None
    return out


def _hand_written(gm: fx.GraphModule, policy: Policy, node: fx.Node,
                  smallest: Optional[Dict[str, float]] = None) -> Dict[fx.Node, Decision]:
    """An eps addition of a hand-written norm planned in the low dtype: its statistics,
    the sum, the root and the normalising op in fp32. ``smallest`` (a deployment plan's
    measured smallest magnitudes): only where the statistic seen gets small enough for
    the eps to count."""
    tiny = torch.finfo(policy.compute).tiny
    if not ops.is_call(node, ops.ADDS, ("add",)) or len(node.args) < 2 \
            or not _is_low(node, policy):
        return {}
    for stat_arg, eps_arg in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        eps = _eps_value(gm, eps_arg)
        if eps is None or not 0 < eps < tiny or not isinstance(stat_arg, fx.Node):
            continue
        stats = _stats_chain(stat_arg)
        if not stats:
            continue
        low = dtype_name(policy.compute)
        seen = None if smallest is None else smallest.get(stat_arg.name)
        if seen is not None and not eps_matters(eps, seen, policy.compute):
            log.info("%s: eps=%g is below %s's smallest normal, but the statistic it is "
                     "added to is at least %.3g on the inputs seen: left in %s", node.name,
                     eps, low, seen, low)
            return {}
        where = ("" if seen is None else f"; its statistic gets down to {seen:.3g} on the "
                 "inputs seen")
        d = Decision(torch.float32, Rule.NORM_EPS,
                     f"eps={eps:g} added in {low} is lost (below its smallest normal "
                     f"{tiny:.2g}){where}: this norm's statistics run in fp32")
        return {member: d for member in stats + [node] + _normalise_chain(node)}
    return {}


#: probe results by ``_probe_key`` (a model's repeated norms of one configuration and
#: shape are probed once; fp16 norm kernels on the CPU are slow); bounded
_PROBED: Dict[tuple, Optional[bool]] = {}
_PROBED_MAX = 4096


def _probe_finite(fn, shape: tuple, dtype: torch.dtype,
                  key: Optional[tuple] = None) -> Optional[bool]:
    """Run ``fn`` on real CPU zeros in ``dtype`` (also when the model is on cuda or meta, or
    the caller is inside a FakeTensorMode): is the result finite? ``key`` (everything the
    result depends on but ``shape`` and ``dtype``; None: not cacheable) memoizes it."""
    shape = (min(shape[0], 2),) + tuple(shape[1:]) if shape else shape
    if key is not None:
        key = key + (tuple(shape), dtype)
        if key in _PROBED:
            return _PROBED[key]
    try:
        with unset_fake_temporarily(), torch.no_grad():
            out = fn(torch.zeros(shape, dtype=dtype, device="cpu"))
            result: Optional[bool] = bool(torch.isfinite(out).all())
    except Exception:  # noqa: BLE001 - a probe that cannot run decides nothing
        log.debug("norm probe failed", exc_info=True)
        result = None
    if key is not None:
        if len(_PROBED) >= _PROBED_MAX:
            _PROBED.clear()
        _PROBED[key] = result
    return result


def _module_key(module: nn.Module) -> Optional[tuple]:
    """What a module probe's result depends on besides the input: the class, its printed
    configuration (children included), its plain attributes and every training flag (the
    probe's state is made from shapes and dtypes alone). None when it cannot be hashed."""
    attrs = tuple(sorted((k, v) for k, v in vars(module).items() if not k.startswith("_")
                         and isinstance(v, (bool, int, float, str, type(None)))))
    state = tuple((name, tuple(t.shape), t.dtype) for name, t in
                  list(module.named_parameters()) + list(module.named_buffers()))
    key = (type(module), repr(module), attrs, state,
           tuple(m.training for m in module.modules()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _function_key(fn: object, args: list, kwargs: dict) -> Optional[tuple]:
    """What a function probe's result depends on besides the input (None: unhashable)."""
    try:
        key = (fn, repr(args), repr(sorted(kwargs.items())))
        hash(key)
    except Exception:  # noqa: BLE001 - an argument without a usable repr or hash
        return None
    return key


def _module_probe(module: nn.Module):  # type: ignore[no-untyped-def]
    """``module`` called with real CPU stand-ins for its tensors (unit weights and variances,
    zero biases and means): the model's own tensors, wherever they live, are not touched."""
    with unset_fake_temporarily():
        state = {name: torch.full(t.shape, 1 if name.rsplit(".", 1)[-1] in
                                  ("weight", "running_var") else 0, dtype=t.dtype)
                 for name, t in list(module.named_parameters())
                 + list(module.named_buffers())}

    def probe(x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, state, (x,), strict=False)
    return probe


def _kernel(gm: fx.GraphModule, policy: Policy, node: fx.Node) -> Dict[fx.Node, Decision]:
    """A norm module or function with a tiny eps whose kernel (probed) gives inf/NaN on a
    constant input in the low dtype: in fp32."""
    tiny = torch.finfo(policy.compute).tiny
    if not _is_low(node, policy) or not node.args or not isinstance(node.args[0], fx.Node):
        return {}
    shape = ir.get(node.args[0]).shape
    if shape is None:
        return {}
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if not isinstance(module, NORM_MODULES) or not 0 < module.eps < tiny:
            return {}
        eps, label = module.eps, type(module).__name__
        probe, key = _module_probe(module), _module_key(module)
    elif ops.is_call(node, NORM_FUNCTIONS):
        eps = ops.arg(node, "eps")
        if not isinstance(eps, float) or not 0 < eps < tiny:
            return {}
        label = ops.callable_label(node.target)
        args = [None if isinstance(a, fx.Node) else a for a in node.args[1:]]
        kwargs = {k: None if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
        fn = node.target
        key = _function_key(fn, args, kwargs)

        def probe(x, fn=fn, args=args, kwargs=kwargs):  # type: ignore[no-untyped-def]
            return fn(x, *args, **kwargs)
    else:
        return {}
    if _probe_finite(probe, shape, policy.compute, key) is False:
        return {node: Decision(torch.float32, Rule.NORM_EPS,
                               f"{label} with eps={eps:g} gives inf/NaN on a constant input "
                               f"in {dtype_name(policy.compute)} (probed): statistics in fp32")}
    return {}


class NormEpsRule(DecisionRule):
    """Norms whose eps the low dtype would lose run in fp32 (see the module docstring):
    hand-written eps additions and norm kernels that give inf/NaN when probed."""

    name = Rule.NORM_EPS

    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        super().__init__(gm, ctx)
        self.smallest: Optional[Dict[str, float]] = None
        self.spread: Optional[Dict[str, Spread]] = None
        if is_deploy(self.policy.target):  # judged on the values seen (ranges.measure)
            measure(gm, ctx)
            self.smallest, self.spread = ctx.smallest, ctx.spread

    def applies(self, node: fx.Node) -> bool:
        return _is_low(node, self.policy)

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        return {**_hand_written(self.gm, self.policy, node, self.smallest),
                **_kernel(self.gm, self.policy, node),
                **_flat_rows(self.gm, self.policy, node, self.spread)}


#: the norm eps pass: ``(gm, ctx) -> PassResult``
norm_eps = rule_pass(NormEpsRule)
