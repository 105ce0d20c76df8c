"""amp_rewrite: trace, annotate, insert casts, recompile; plan_of."""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .. import __version__
from ..errors import FxampError, UnsupportedModelError
from ..passes import custom_ops, joins, loss, norm_eps, softmax
from ..passes.annotate import META, annotate, check_banned, fix
from ..passes.ranges import collect_ranges, keep_in_range
from ..passes.casts import insert_casts
from ..plan import Plan, RangeStats
from ..policy import Policy, make_policy
from .trace import trace

log = logging.getLogger(__name__)

#: passes that run on the traced graph before it is annotated (they need no dtypes)
GRAPH_PASSES = (softmax.stable_softmax, custom_ops.fence_custom_ops)
#: numerics passes, in order: each reads the plan in node.meta and fixes decisions; the
#: dtypes are propagated again after each pass that changed something
NUMERICS_PASSES = (norm_eps.norm_eps, loss.loss_in_fp32, joins.consistent_joins)

_PLAN_ATTR = "fxamp_plan"
_POLICY_ATTR = "fxamp_policy"


def _as_tuple(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"amp_rewrite takes a torch.nn.Module, got {type(model).__name__}; "
            "what to do: wrap the callable in an nn.Module")
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16):
            raise UnsupportedModelError(
                f"parameter {name!r} is already {p.dtype}; fxamp keeps FP32 master weights "
                "and casts per op. what to do: call model.float() before amp_rewrite")


def _header(policy: Policy) -> dict:
    return {"fxamp": __version__, "torch": torch.__version__.split("+")[0],
            "policy": str(policy), "frontend": "fx"}


def plan_of(gm: nn.Module) -> Plan:
    """The Plan that amp_rewrite used to make ``gm``."""
    plan = getattr(gm, _PLAN_ATTR, None)
    if not isinstance(plan, Plan):
        raise FxampError(f"{type(gm).__name__} was not made by fxamp.amp_rewrite; "
                         "what to do: call fxamp.amp_rewrite(model, example_inputs) first")
    return plan


def amp_rewrite(model: nn.Module, example_inputs: Optional[Union[Sequence[Any], Any]] = None,
                *, dtype: torch.dtype = torch.float16, target: str = "cuda",
                policy: Union[None, str, Policy] = None,
                calibration_data: Union[None, Iterable[Any], Plan,
                                        Dict[str, RangeStats]] = None) -> fx.GraphModule:
    """Rewrite ``model`` into an explicit mixed-precision ``GraphModule``.

    Each node computes in the dtype ``torch.autocast(target, dtype)`` would give it (or the
    policy's override, or a numerics pass's decision), with explicit casts; Parameters stay
    FP32 and shared with ``model``. ``example_inputs`` (a tuple of the forward's arguments)
    decide dtypes exactly. ``calibration_data`` (an iterable of input tuples, or a Plan whose
    ranges to reuse) keeps in FP32 the nodes whose values pass the low dtype's range.
    """
    pol = make_policy(policy, dtype, target)
    _check_model(model)
    if getattr(model, _PLAN_ATTR, None) is not None:
        if getattr(model, _POLICY_ATTR) == pol:
            log.info("model was already rewritten with the same policy; returning it")
            return model  # type: ignore[return-value]
        raise UnsupportedModelError(
            f"this model was already rewritten by fxamp with policy "
            f"{getattr(model, _POLICY_ATTR)}; asked for {pol}. what to do: rewrite the "
            "original FP32 model instead")
    if example_inputs is None:
        raise FxampError("amp_rewrite needs example_inputs (a tuple of the forward's "
                         "arguments) to know which values are floating tensors; what to do: "
                         "pass e.g. (torch.randn(1, 3, 224, 224),)")
    return rewrite(model, _as_tuple(example_inputs), pol, calibration_data)


def rewrite(model: nn.Module, inputs: tuple, pol: Policy,
            calibration_data: Union[None, Iterable[Any], Plan, Dict[str, RangeStats]] = None,
            fixed: Optional[Dict[str, Tuple[torch.dtype, str, str]]] = None) -> fx.GraphModule:
    """The pipeline behind amp_rewrite. ``fixed`` maps node names to (dtype, rule, reason)
    decisions made outside the passes (the tolerance search)."""
    src = trace(model)
    for name, (dtype, rule, reason) in (fixed or {}).items():
        node = next((n for n in src.graph.nodes if n.name == name), None)
        if node is None:
            raise FxampError(f"no node named {name!r} in the traced graph")
        fix(node, dtype, rule, reason)
    if pol.numerics:
        for graph_pass in GRAPH_PASSES:
            if graph_pass(src, pol).modified:
                src.graph.lint()
                src.recompile()
    annotate(src, inputs, pol)
    if pol.numerics:
        for numerics_pass in NUMERICS_PASSES:
            if numerics_pass(src, pol).modified:
                log.debug("%s changed decisions", numerics_pass.__name__)
                annotate(src, inputs, pol)
    stats = _ranges(src, calibration_data, pol)
    if stats and keep_in_range(src, pol, stats).modified:
        annotate(src, inputs, pol)
    check_banned(src)
    gm = insert_casts(src, pol).graph_module
    gm.graph.lint()
    gm.recompile()
    plan = Plan(nodes={n.name: n.meta[META] for n in src.graph.nodes if n.meta.get(META)},
                header=_header(pol), ranges=stats)
    setattr(gm, _PLAN_ATTR, plan)
    setattr(gm, _POLICY_ATTR, pol)
    _copy_training_flags(model, gm)
    return gm


def _ranges(src: fx.GraphModule, data: Any, pol: Policy) -> Dict[str, RangeStats]:
    if data is None:
        return {}
    if isinstance(data, Plan):
        return dict(data.ranges)
    if isinstance(data, dict):
        return dict(data)
    return collect_ranges(src, data, pol.compute)


def _copy_training_flags(model: nn.Module, gm: fx.GraphModule) -> None:
    """Give gm and the container modules fx made for it the model's training flags,
    leaving the modules it shares with the model (a frozen BatchNorm, say) as they are."""
    shared = {id(m) for m in model.modules()}
    originals = dict(model.named_modules())
    for name, module in gm.named_modules():
        if id(module) not in shared and name in originals:
            module.training = originals[name].training
    gm.training = model.training
