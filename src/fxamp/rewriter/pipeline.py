"""amp_rewrite: trace, annotate, insert casts, recompile; plan_of."""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .. import __version__, oplists
from ..errors import FxampError, PolicyError, TraceError, UnsupportedModelError
from .. import ir
from ..ir import fix
from ..passes import PassResult
from ..passes.manager import PassContext, PassManager
from ..plan import Plan, RangeStats
from ..policy import Policy, dtype_name, make_policy, parse_compute_dtype
from .eager_root import eager_root, submodule_calls
from .export_front import ShapeCheck, export_trace, flat_inputs, plain_inputs_hook
from .hooks import (check_global_hooks, copy_root_hooks, hooked_modules, mark_hooked_runtime,
                    without_root_hooks)
from .inputs import check_example_inputs
from .overrides import Scope, check_matched, override_scope
from .pass_list import annotate_step, pass_list
from .state import ModelState, report_side_effects
from .state_dict import complete_state
from .trace import trace

log = logging.getLogger(__name__)


#: front ends amp_rewrite can trace with; "auto" tries fx, then export, then partial fx
FRONTENDS = ("auto", "fx", "export")
#: partial tracing gives up after this many untraceable submodules
MAX_RUNTIME_LEAVES = 32

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


def _header(policy: Policy, frontend: str, leaves: Sequence[str] = (),
            nested: Optional[Dict[str, Plan]] = None) -> dict:
    header = {"fxamp": __version__, "torch": torch.__version__.split("+")[0],
              "policy": str(policy), "frontend": frontend}
    nested = nested or {}
    runtime = [leaf for leaf in leaves if leaf not in nested]
    if runtime:
        header["runtime leaves"] = " ".join(runtime)
    if nested:
        header["nested"] = " ".join(f"{path}={plan.header['frontend']}"
                                    for path, plan in nested.items())
    return header


def _rewrite_leaves(model: nn.Module, src: fx.GraphModule, leaves: Sequence[str],
                    args: tuple, kwargs: Dict[str, Any], pol: Policy) -> Dict[str, Plan]:
    """Rewrite each untraceable leaf on its own where a front end takes it; the others
    stay runtime calls. Returns the nested plans by leaf path."""
    captured = submodule_calls(model, leaves, args, kwargs)
    inner = dataclasses.replace(pol, output_dtype=None)  # values flow on in their dtype
    nested: Dict[str, Plan] = {}
    for path in leaves:
        if path not in captured:
            continue
        leaf_args, leaf_kwargs, _ = captured[path]
        try:
            with override_scope(path):
                sub = rewrite(model.get_submodule(path), tuple(leaf_args), inner,
                              kwargs=leaf_kwargs)
        except FxampError as err:
            log.info("%s stays a runtime call: %s", path, str(err).splitlines()[0])
            continue
        parent, _, name = path.rpartition(".")
        setattr(src.get_submodule(parent) if parent else src, name, sub)
        nested[path] = plan_of(sub)
    return nested


def plan_of(gm: nn.Module) -> Plan:
    """The Plan that amp_rewrite used to make ``gm``."""
    plan = getattr(gm, _PLAN_ATTR, None)
    if not isinstance(plan, Plan):
        raise FxampError(f"{type(gm).__name__} was not made by fxamp.amp_rewrite; "
                         "what to do: call fxamp.amp_rewrite(model, example_inputs) first")
    return plan


def amp_rewrite(model: nn.Module, example_inputs: Optional[Union[Sequence[Any], Any]] = None,
                *, example_kwargs: Optional[Dict[str, Any]] = None,
                dtype: Optional[torch.dtype] = None, target: str = "cuda",
                policy: Union[None, str, Policy] = None,
                calibration_data: Union[None, Iterable[Any], Plan,
                                        Dict[str, RangeStats]] = None,
                frontend: str = "auto", dynamic_shapes: Any = None) -> fx.GraphModule:
    """Rewrite ``model`` into an explicit mixed-precision ``GraphModule`` (for the "eager"
    front end, a copy of the model whose children are such modules).

    Each node computes in the dtype ``torch.autocast(target, dtype)`` would give it (or the
    policy's override, or a numerics pass's decision), with explicit casts; Parameters stay
    FP32 and shared with ``model``. ``example_inputs`` (a tuple of the forward's arguments)
    decide dtypes exactly. ``calibration_data`` (an iterable of input tuples, or a Plan whose
    ranges to reuse) keeps in FP32 the nodes whose values pass the low dtype's range.

    ``frontend``: "fx" (torch.fx.symbolic_trace), "export" (torch.export, ATen-level, needs
    the example inputs; keyword arguments go in ``example_kwargs``) or "auto": fx, then
    export, then fx with the submodules neither can take kept as calls that run under
    torch.autocast (``rule="runtime"``). The plan header records which one took the model.

    ``dynamic_shapes`` (torch.export's own spelling, passed to it) says which input
    dimensions the export front end keeps symbolic; by default the batch (dim 0 of every
    tensor input) and the sequence (dim 1 of integer inputs: token ids, masks), all others
    static. A call of the result with another size on a static dimension raises
    InputShapeError. (fx graphs take any size: the fx front end ignores it.)

    ``dtype`` defaults to float16 (or the policy's ``compute=``; the two must agree).
    When the rewrite fails, the model is run once in FP32 on the example inputs: if that
    fails too, the model's own error is raised (``ExampleInputError``). The model is left
    exactly as it was (see ``rewriter/state.py``).
    """
    pol = _policy(policy, dtype, target)
    if frontend not in FRONTENDS:
        raise FxampError(f"unknown frontend {frontend!r}; valid: {', '.join(FRONTENDS)}")
    _check_model(model)
    if getattr(model, _PLAN_ATTR, None) is not None:
        if getattr(model, _POLICY_ATTR) == pol:
            log.info("model was already rewritten with the same policy; returning it")
            return model  # type: ignore[return-value]
        raise UnsupportedModelError(
            f"this model was already rewritten by fxamp with policy "
            f"{getattr(model, _POLICY_ATTR)}; asked for {pol}. what to do: rewrite the "
            "original FP32 model instead")
    if example_inputs is None and not example_kwargs:
        raise FxampError("amp_rewrite needs example_inputs (a tuple of the forward's "
                         "arguments) to know which values are floating tensors; what to do: "
                         "pass e.g. (torch.randn(1, 3, 224, 224),)")
    args = () if example_inputs is None else _as_tuple(example_inputs)
    check_global_hooks()
    state = ModelState(model)
    grad = torch.is_grad_enabled()
    try:
        with state.watch():
            try:
                return rewrite(model, args, pol, calibration_data, kwargs=example_kwargs,
                               frontend=frontend, dynamic_shapes=dynamic_shapes)
            except Exception:
                # when the FP32 model itself fails on the example inputs, that is the cause:
                # report the model's own error, not the tracer's (checked only on failure:
                # one forward costs as much as a rewrite of a large model)
                state.restore()
                problem = check_example_inputs(model, args, dict(example_kwargs or {}),
                                               pol.compute)
                if problem is None:
                    raise
                raise problem from problem.__cause__
    finally:
        torch.set_grad_enabled(grad)
        state.restore()
        report_side_effects(model, state.restored)


def _policy(policy: Union[None, str, Policy], dtype: Optional[torch.dtype],
            target: str) -> Policy:
    """make_policy, refusing a ``dtype`` that the policy's compute dtype contradicts."""
    pol = make_policy(policy, torch.float16 if dtype is None else dtype, target)
    if dtype is not None:
        asked = parse_compute_dtype(dtype)
        if asked != pol.compute:
            raise PolicyError(
                f"dtype={asked} conflicts with the policy's compute={dtype_name(pol.compute)}"
                f" ({policy}); what to do: give the low dtype once, either dtype= or "
                "compute= in the policy")
    return pol


def _fx_inputs(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The fx graph's placeholder values: the forward's parameters bound in order."""
    if not kwargs:
        return args
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _partial_trace(model: nn.Module, error: TraceError, state: ModelState
                   ) -> Tuple[fx.GraphModule, List[str]]:
    """fx tracing with each submodule that fails kept as a call (run under autocast)."""
    leaves: List[str] = []
    while True:
        path = getattr(error, "module", "")
        if not path or path in leaves or len(leaves) >= MAX_RUNTIME_LEAVES:
            raise error
        leaves.append(path)
        try:
            return trace(model, leaves, "auto"), leaves
        except TraceError as err:
            error = err
            state.restore()


def _refuse_hooks_in_export(model: nn.Module) -> None:
    """torch.export runs hooks once, at export time, on fake tensors: refused."""
    hooked = hooked_modules(model)
    if hooked:
        path, names = next(iter(hooked.items()))
        raise TraceError(
            f"torch.export would run the hooks of {type(model).__name__}.{path} ("
            f"{', '.join(names)}) once while exporting instead of on every call"
            + (f" (and {len(hooked) - 1} more hooked modules)" if len(hooked) > 1 else "")
            + "\n  what to do: frontend='fx' or 'auto' keep hooked modules as calls that run "
            "their hooks; or remove the hooks before amp_rewrite")


def trace_model(model: nn.Module, args: tuple, kwargs: Dict[str, Any], frontend: str,
                state: Optional[ModelState] = None, dynamic_shapes: Any = None
                ) -> Tuple[fx.GraphModule, str, tuple, List[str]]:
    """(graph module, front end that took it, its placeholder values, runtime leaves).
    ``state`` (the model's snapshot) is restored after each front end that fails."""
    state = state or ModelState(model)
    if frontend == "export":
        _refuse_hooks_in_export(model)
        with without_root_hooks(model):
            gm = export_trace(model, args, kwargs, dynamic_shapes=dynamic_shapes)
        return gm, "export", flat_inputs(gm, args, kwargs), []
    try:
        return trace(model, (), frontend), "fx", _fx_inputs(model, args, kwargs), []
    except TraceError as err:
        state.restore()
        if frontend == "fx":
            raise
        fx_error = err
    try:
        _refuse_hooks_in_export(model)
        with without_root_hooks(model):
            gm = export_trace(model, args, kwargs, "auto", dynamic_shapes)
        log.info("torch.fx could not trace %s; torch.export took it", type(model).__name__)
        return gm, "export", flat_inputs(gm, args, kwargs), []
    except TraceError as err:
        export_error = err
        state.restore()
    try:
        gm, leaves = _partial_trace(model, fx_error, state)
    except TraceError as err:
        raise TraceError(f"no front end takes {type(model).__name__}.\n- fx: {fx_error}\n"
                         f"- export: {export_error}") from err
    log.info("%s: torch.fx and torch.export fail; traced around %s",
             type(model).__name__, ", ".join(leaves))
    return gm, "fx+runtime", _fx_inputs(model, args, kwargs), leaves


def rewrite(model: nn.Module, inputs: tuple, pol: Policy,
            calibration_data: Union[None, Iterable[Any], Plan, Dict[str, RangeStats]] = None,
            fixed: Optional[Dict[str, Tuple[torch.dtype, str, str]]] = None,
            kwargs: Optional[Dict[str, Any]] = None, frontend: str = "auto",
            dynamic_shapes: Any = None) -> fx.GraphModule:
    """The pipeline behind amp_rewrite. ``fixed`` maps node names to (dtype, rule, reason)
    decisions made outside the passes (the tolerance search). The top-level rewrite (not
    one nested in another) raises PolicyError when an override of ``pol`` matches no node."""
    with override_scope() as scope:
        return _rewrite(model, inputs, pol, calibration_data, fixed, kwargs, frontend, scope,
                        dynamic_shapes)


def _plan_lines(nodes: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    """(node name, module path, op) of each plan line: what overrides are matched against."""
    return [(name, p.module, p.op) for name, p in nodes.items()]


def _nested_reason(reason: str, path: str, name: str) -> str:
    """A nested plan line's reason under ``path/``: "its nodes are the plan lines name/*"
    names them by their full plan names, ``path/name/*``."""
    return reason.replace(f"plan lines {name}/*", f"plan lines {path}/{name}/*")


def _plan_nodes(src: fx.GraphModule, nested: Dict[str, Plan]) -> Dict[str, Any]:
    """The plan lines of ``src``'s decided nodes, then each nested plan's under ``path/``."""
    nodes = {n.name: ir.precision(n) for n in src.graph.nodes if ir.precision(n)}
    for path, sub_plan in nested.items():
        nodes.update({f"{path}/{name}": dataclasses.replace(
            p, module=f"{path}.{p.module}" if p.module else path,
            reason=_nested_reason(p.reason, path, name))
            for name, p in sub_plan.nodes.items()})
    return nodes


def _rewrite(model: nn.Module, inputs: tuple, pol: Policy, calibration_data: Any,
             fixed: Optional[Dict[str, Tuple[torch.dtype, str, str]]],
             kwargs: Optional[Dict[str, Any]], frontend: str, scope: Scope,
             dynamic_shapes: Any = None) -> fx.GraphModule:
    kwargs = dict(kwargs or {})
    state = ModelState(model)
    try:
        src, taken, flat, leaves = trace_model(model, inputs, kwargs, frontend, state,
                                               dynamic_shapes)
    except TraceError as err:
        state.restore()
        if frontend != "auto" or getattr(err, "module", "") or fixed or calibration_data:
            raise
        try:  # the model's own forward is what fails: rewrite its children instead
            result = eager_root(model, inputs, kwargs, pol, rewrite, _header(pol, "eager"))
        except FxampError:
            raise err from None
        if scope.top:
            check_matched(pol, scope, _plan_lines(plan_of(result).nodes))
        log.warning("%s: no tracer takes its forward; it runs eagerly under torch.autocast "
                    "with its children rewritten (%s)", type(model).__name__,
                    plan_of(result).header.get("nested", ""))
        return result  # type: ignore[return-value]
    if taken != "export":
        hooked = mark_hooked_runtime(src)
        if hooked:
            log.info("%s: modules with hooks stay calls run under torch.autocast: %s",
                     type(model).__name__, ", ".join(hooked))
    nested = _rewrite_leaves(model, src, leaves, inputs, kwargs, pol) if leaves else {}
    runtime = [leaf for leaf in leaves if leaf not in nested]
    if runtime:
        log.warning("%s: torch.fx and torch.export cannot take %s; they run under "
                    "torch.autocast at run time (rule 'runtime')", type(model).__name__,
                    ", ".join(runtime))
    example, inputs = (inputs, kwargs), flat
    if taken == "export" and calibration_data is not None and not isinstance(
            calibration_data, (Plan, dict)):
        calibration_data = [flat_inputs(src, _as_tuple(batch), {})
                            for batch in calibration_data]
    for name, (dtype, rule, reason) in (fixed or {}).items():
        node = next((n for n in src.graph.nodes if n.name == name), None)
        if node is None:
            raise FxampError(f"no node named {name!r} in the traced graph")
        fix(node, dtype, rule, reason)
    ctx = PassContext(pol, inputs, calibration=_calibration(calibration_data),
                      ranges=_given_ranges(calibration_data),
                      annotate=lambda gm, ctx: annotate_step(gm, ctx, state))
    steps = pass_list(lambda gm, ctx: _check_overrides(gm, pol, scope, nested))
    gm = PassManager(steps)(src, ctx).graph_module  # GraphModule() compiled it already
    stats = ctx.ranges or {}
    plan = Plan(nodes=_plan_nodes(src, nested), header=_header(pol, taken, leaves, nested),
                ranges=stats)
    setattr(gm, _PLAN_ATTR, plan)
    gm.fxamp_source = oplists.module_label(model)
    setattr(gm, _POLICY_ATTR, pol)
    _copy_training_flags(model, gm)
    complete_state(model, gm)
    copy_root_hooks(model, gm)
    if taken == "export":
        gm.register_forward_pre_hook(ShapeCheck(src, model, *example), with_kwargs=True)
        gm.register_forward_pre_hook(plain_inputs_hook, with_kwargs=True)
    return gm


def _check_overrides(gm: fx.GraphModule, pol: Policy, scope: Scope,
                     nested: Dict[str, Plan]) -> PassResult:
    """The top-level rewrite raises PolicyError for an override that matches no node."""
    if scope.top:
        check_matched(pol, scope, _plan_lines(_plan_nodes(gm, nested)))
    return PassResult(gm, modified=False)


def _given_ranges(data: Any) -> Optional[Dict[str, RangeStats]]:
    """The range statistics given as a Plan or a dict (None: collected from batches)."""
    if data is None:
        return {}
    if isinstance(data, Plan):
        return dict(data.ranges)
    if isinstance(data, dict):
        return dict(data)
    return None


def _calibration(data: Any) -> Any:
    """Calibration batches to collect ranges from (None when statistics were given)."""
    return None if data is None or isinstance(data, (Plan, dict)) else data


def _copy_training_flags(model: nn.Module, gm: fx.GraphModule) -> None:
    """Give gm and the container modules fx made for it the model's training flags,
    leaving the modules it shares with the model (a frozen BatchNorm, say) as they are."""
    shared = {id(m) for m in model.modules()}
    originals = dict(model.named_modules())
    for name, module in gm.named_modules():
        if id(module) not in shared and name in originals:
            module.training = originals[name].training
    gm.training = model.training
