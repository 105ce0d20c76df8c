"""Annotate pass: autocast's op lists for the target decide each node's precision.

For every node with a floating output it writes ``node.meta["fxamp"] = NodePrecision``.
The dtypes come from running the graph on fake tensors (no real compute, no state change)
with each node's planned input casts applied, so a node on no list gets exactly the dtype
its inputs give it, as under autocast.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensorMode,
                                           unset_fake_temporarily)
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map

from .. import oplists
from ..errors import UnsupportedModelError, node_error
from ..plan import NodePrecision, Plan
from ..policy import Policy, dtype_name
from .. import overrides
from ..runtime import device_autocast, eligible
from . import PassResult, observe

log = logging.getLogger(__name__)

META = "fxamp"
VALUE = "fxamp_value"  # "tensor" | "seq": what kind of value carries the floating output
SHAPE = "fxamp_shape"  # shape of the first floating tensor of the output
FIXED = "fxamp_fixed"  # a numerics pass's Decision, honoured by later annotate runs


def module_path(node: fx.Node) -> str:
    """The module a node belongs to: its target for call_module, else the innermost module."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def float_leaves(value: Any) -> List[torch.Tensor]:
    """The floating tensors in a (nested) value, in order: through tuples, lists, dicts,
    registered pytree nodes (Hugging Face ``ModelOutput``) and dataclasses."""
    leaves, _ = tree_flatten(value)
    out: List[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.is_floating_point():
                out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += float_leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return out


def first_float(value: Any) -> Optional[torch.Tensor]:
    """The first floating tensor in a (nested) value, or None."""
    leaves = float_leaves(value)
    return leaves[0] if leaves else None


class Decision:
    """A node's planned input dtype, rule and reason, before its output dtype is known."""

    __slots__ = ("inputs", "rule", "reason", "label", "runtime")

    def __init__(self, inputs: Optional[torch.dtype], rule: str, reason: str, label: str,
                 runtime: bool = False) -> None:
        self.inputs, self.rule, self.reason = inputs, rule, reason
        self.label, self.runtime = label, runtime


def decide(node: fx.Node, root: nn.Module, args: tuple, kwargs: dict,
           policy: Policy) -> Decision:
    """What autocast (or the policy) does with ``node`` given its input values."""
    target, low = policy.target, policy.compute
    if node.op == "placeholder":
        return Decision(None, "autocast", "model input", "placeholder")
    if node.op == "get_attr":
        return Decision(None, "autocast", "FP32 master weight or buffer", "get_attr")
    label, ops = oplists.node_ops(node, root)
    path = module_path(node)
    # "encoder.layer.0.*" covers the layer's own functional ops as well as its submodules
    override = overrides.match(policy, *overrides.node_names(node.name, path, label))
    if override is not None:
        return Decision(override.dtype, "user", f"policy override {override}", label)
    fixed = node.meta.get(FIXED)
    if fixed is not None:
        return Decision(fixed.inputs, fixed.rule, fixed.reason, label, fixed.runtime)
    if node.op == "call_module" and node.target == "_guards_fn":
        return Decision(None, "autocast", "torch.export's check of the input shapes", label)
    if node.op == "call_module" and isinstance(
            getattr(root.get_submodule(node.target), "fxamp_plan", None), Plan):
        source = getattr(root.get_submodule(node.target), "fxamp_source", label)
        # it was planned with the FP32 model's inputs: it gets FP32 inputs
        return Decision(torch.float32, "nested", "rewritten on its own (a submodule the "
                        "whole-model trace could not take), planned for FP32 inputs; its nodes "
                        f"are the plan lines {node.target}/*", source)
    if ops is oplists.RUNTIME:
        return Decision(None, "runtime", "opaque call: torch.autocast decides inside it at "
                        "run time", label, runtime=True)
    category, op = oplists.category_of(ops, target)
    if category == oplists.LOWER:
        return Decision(low, "autocast",
                        f"{op} is on autocast's lower-precision list for {target}", label)
    if category == oplists.FP32:
        return Decision(torch.float32, "autocast",
                        f"{op} is on autocast's fp32 list for {target}", label)
    if category == oplists.FP32_OPT:
        explicit = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype)
                                                          for a in args[1:])
        if explicit:
            return Decision(None, "autocast", f"{op} runs in the dtype it is given", label)
        return Decision(torch.float32, "autocast",
                        f"{op} runs in fp32 under autocast for {target} (no dtype given)", label)
    if category == oplists.PROMOTE:
        leaves, _ = tree_flatten((args, kwargs))
        dtypes = [v.dtype for v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if node.op == "call_module":
            dtypes += [p.dtype for p in root.get_submodule(node.target).parameters()
                       if p.is_floating_point()]
        widest = observe.widest(dtypes)
        return Decision(widest, "autocast", f"{op} runs in the widest dtype of its inputs "
                        f"({dtype_name(widest)}) under autocast for {target}", label)
    if category == oplists.BANNED:
        return Decision(None, "banned", f"{op} is unsafe in {dtype_name(low)} and "
                        "torch.autocast refuses it", label)
    return Decision(None, "autocast", "on no autocast list: follows its inputs", label)


def fix(node: fx.Node, inputs: Optional[torch.dtype], rule: str, reason: str) -> bool:
    """Record a numerics pass's decision for ``node``; True if it changed anything."""
    new = Decision(inputs, rule, reason, "")
    old = node.meta.get(FIXED)
    if old is not None and (old.inputs, old.rule, old.reason) == (inputs, rule, reason):
        return False
    node.meta[FIXED] = new
    return True


def check_banned(gm: fx.GraphModule) -> None:
    """Raise for any node still planned with a banned op (autocast refuses those too)."""
    for node in gm.graph.nodes:
        p = node.meta.get(META)
        if p is not None and p.rule == "banned":
            raise node_error(
                UnsupportedModelError, node, p.reason,
                "use binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss on logits, or "
                f"keep this node in FP32 with the policy override 'fp32:{node.name}'")


def _cast(dtype: Optional[torch.dtype]) -> Callable[[Any], Any]:
    def cast(value: Any) -> Any:
        if dtype is not None and eligible(value) and value.dtype != dtype:
            return value.to(dtype)
        return value
    return cast


_VALUE_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
_CALLS = ("call_function", "call_method", "call_module")
def _real_stand_in(value: Any, device: Optional[torch.device] = None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    fill = torch.ones if value.is_floating_point() else torch.zeros
    return fill(value.shape, dtype=value.dtype, device=device)


#: CUDA-only ops with no fake kernel, planned without a GPU: an op with the same output
#: (shape and dtype) that has one
_SAME_SHAPE_AS: Dict[str, Callable[..., Any]] = {
    "cudnn_convolution": lambda x, w, padding, stride, dilation, groups, *_, **__:
        torch.ops.aten.convolution(x, w, None, stride, padding, dilation, False,
                                   [0] * len(padding), groups),
    "cudnn_convolution_transpose": lambda x, w, padding, output_padding, stride, dilation,
    groups, *_, **__: torch.ops.aten.convolution(x, w, None, stride, padding, dilation, True,
                                                 output_padding, groups),
}


class _Simulator(fx.Interpreter):
    """Runs the source graph on fake tensors with the planned input casts applied.

    Each call the op tables leave to autocast is also run under real autocast of the target
    (``observe``); where the two differ in the casts made or the dtypes produced, autocast's
    observed behaviour is the decision."""

    def __init__(self, gm: fx.GraphModule, policy: Policy, fake_mode: FakeTensorMode,
                 home: torch.device) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.policy = policy
        self.fake_mode = fake_mode
        self.home = home
        self.decisions: Dict[str, Tuple[Decision, Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        d = decide(n, self.module, args, kwargs, self.policy)
        params = (dict(self.fetch_attr(n.target).named_parameters())
                  if n.op == "call_module" else {})
        values = observe.float_inputs(args, kwargs, params)
        if d.rule == "autocast" and d.inputs is not None and values and not any(
                eligible(v) for v in values):
            d = Decision(None, "autocast", "float64 inputs: torch.autocast leaves float64 "
                         "alone", d.label)
        obs = (self._observe(n, args, kwargs, params)
               if n.op in _CALLS and d.rule == "autocast" and not d.runtime else None)
        if obs is not None and obs.banned:
            d = Decision(None, "banned", f"{d.label} is unsafe in "
                         f"{dtype_name(self.policy.compute)}: torch.autocast refuses it "
                         f"({obs.message})", d.label)
        try:
            result, error = self._run(n, d, args, kwargs), None
        except Exception as err:  # noqa: BLE001 - autocast's own choice may still work
            result, error = None, err
        if obs is not None and obs.outputs is None:  # no fake kernel: autocast's casts
            if observe.planned_casts(values, d.inputs, eligible) != obs.casts:
                d = self._observed_decision(d, obs)
                try:
                    result, error = self._run(n, d, args, kwargs), None
                except Exception as err:  # noqa: BLE001
                    error = err
        elif obs is not None and not obs.banned and (
                error is not None or self._differs(d, obs, values, result)):
            # the tables are wrong here: autocast's casts of the inputs, or, where autocast
            # casts inside the call (no input casts reproduce it), autocast at run time
            d = self._observed_decision(d, obs)
            if not obs.inside:
                try:
                    result, error = self._run(n, d, args, kwargs), None
                except Exception as err:  # noqa: BLE001
                    error = err
            if obs.inside or error is not None or self._differs(d, obs, values, result):
                d = Decision(None, "runtime", f"torch.autocast({self.policy.target!r}) "
                             "casts inside this call, not only its inputs (observed): it "
                             "runs under torch.autocast at run time", d.label, runtime=True)
                try:
                    result, error = self._run(n, d, args, kwargs), None
                except Exception as err:  # noqa: BLE001
                    error = err
        if error is not None:
            raise node_error(
                UnsupportedModelError, n,
                f"{d.label} fails with the planned dtypes ({d.rule}: {d.reason}): "
                f"{type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}",
                "check that the model runs under torch.autocast for this target and dtype, "
                f"or keep the node in FP32 with the policy override 'fp32:{n.name}'"
            ) from error
        self.decisions[n.name] = (d, result)
        return result

    def _observe(self, n: fx.Node, args: tuple, kwargs: dict,
                 params: Dict[str, torch.Tensor]) -> Optional[observe.Observation]:
        """What real autocast does with this call on these inputs (cached per signature);
        None when the call has no floating input or cannot run under autocast on fakes."""
        values = observe.float_inputs(args, kwargs, params)
        if not values:
            return None
        module = self.fetch_attr(n.target) if n.op == "call_module" else None
        buffers = dict(module.named_buffers()) if module is not None else {}
        op = ((type(module), module.extra_repr(), module.training) if module is not None
              else (n.op, n.target))
        key = observe.call_key(op, (args, kwargs, params, buffers),
                               (self.policy.target, self.policy.compute))
        if key is not None and key in observe.CACHE:
            return observe.CACHE.get(key)

        def call(a: tuple, k: dict, p: dict, b: dict) -> Any:
            if n.op == "call_module":
                return torch.func.functional_call(self.fetch_attr(n.target), {**p, **b}, a, k,
                                                  strict=False)
            return getattr(self, n.op)(n.target, a, k)

        try:
            obs = observe.observe(call, args, kwargs, params, buffers, self.policy.target,
                                  self.policy.compute)
        except Exception:  # noqa: BLE001 - the op tables decide alone
            log.debug("%s: not observable under autocast on fake tensors", n.name,
                      exc_info=True)
            obs = None
        if key is not None:
            observe.CACHE.put(key, obs)
        return obs

    @staticmethod
    def _differs(d: Decision, obs: observe.Observation, values: List[torch.Tensor],
                 result: Any) -> bool:
        """Whether decision ``d`` (run as ``result``) is not what autocast did: other output
        dtypes, or casts of the inputs where autocast casts inside the call instead. (Input
        casts that autocast folds into the kernel — CUDA's fp16-in, fp32-out softmax —
        count as the same.)"""
        if observe.float_dtypes(result) != obs.outputs:
            return True
        return obs.inside and observe.planned_casts(values, d.inputs, eligible) != obs.casts

    def _observed_decision(self, d: Decision, obs: observe.Observation) -> Decision:
        target = self.policy.target
        dtype = obs.cast_dtype
        did = (f"casts its inputs to {dtype_name(dtype)}" if dtype is not None
               else "leaves its inputs as they are")
        return Decision(dtype, "autocast", f"torch.autocast({target!r}) {did} (observed; "
                        f"the op tables said: {d.reason})", d.label)

    def _run(self, n: fx.Node, d: Decision, args: tuple, kwargs: dict) -> Any:
        """The node with its planned input casts applied."""
        if d.inputs is not None:  # (no planned dtype: the values pass unchanged)
            args, kwargs = tree_map(_cast(d.inputs), (args, kwargs))
        try:
            return self._execute(n, d, args, kwargs)
        except _VALUE_DEPENDENT:
            return self._execute_on_real(n, d, args, kwargs)
        except NotImplementedError as err:  # an op with no fake kernel (CUDA-only ops)
            if "Meta" not in str(err):
                raise
            same_shape = _SAME_SHAPE_AS.get(getattr(n.target, "__name__", ""))
            if same_shape is not None and not torch.cuda.is_available():
                return same_shape(*args, **kwargs)
            return self._execute_on_real(n, d, args, kwargs)

    def _in_autocast(self, n: fx.Node, args: tuple, kwargs: dict, device: torch.device) -> Any:
        """Run an opaque call under autocast of ``device``'s type on fake copies there; the
        result comes back on the node's own device."""
        home = observe.device_of((args, kwargs)) or self.home
        memo: Dict[int, Any] = {}
        args, kwargs = observe.on_device((args, kwargs), device, memo)
        with device_autocast(device.type, self.policy.compute):
            if n.op == "call_module":
                module = self.fetch_attr(n.target)
                state = observe.on_device(dict(list(module.named_parameters())
                                               + list(module.named_buffers())), device, memo)
                result = torch.func.functional_call(module, state, args, kwargs, strict=False)
            else:
                result = getattr(self, n.op)(n.target, args, kwargs)
        return observe.on_device(result, home)

    def _execute_on_real(self, n: fx.Node, d: Decision, args: tuple, kwargs: dict) -> Any:
        """Ops whose fake kernels need values (checks like ``var < 0``, ``.item()``) run on
        real stand-ins — ones for floats, zeros for integers — only to learn the dtypes."""
        mode = self.fake_mode
        home = observe.device_of((args, kwargs)) or self.home
        # stand-ins on the model's GPU where there is one (CUDA-only ops), else on the CPU
        device = home if home.type == "cuda" and torch.cuda.is_available() else None
        autocast = (torch.autocast(device.type if device else "cpu",
                                   dtype=self.policy.compute) if d.runtime
                    else contextlib.nullcontext())
        with unset_fake_temporarily(), autocast:
            args, kwargs = tree_map(lambda v: _real_stand_in(v, device), (args, kwargs))
            if n.op == "call_module":
                module = self.fetch_attr(n.target)
                state = {k: _real_stand_in(v, device) for k, v in
                         list(module.named_parameters()) + list(module.named_buffers())}
                if d.inputs is not None:
                    state = {k: _cast(d.inputs)(v) for k, v in state.items()}
                result = torch.func.functional_call(module, state, args, kwargs, strict=False)
            else:
                result = getattr(self, n.op)(n.target, args, kwargs)
        result = tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                          result)
        return observe.on_device(result, home) if home.type != "cpu" else result

    def _execute(self, n: fx.Node, d: Decision, args: tuple, kwargs: dict) -> Any:
        if d.runtime:
            try:
                return self._in_autocast(n, args, kwargs, torch.device(self.policy.target))
            except Exception:  # noqa: BLE001 - e.g. CPU constants made inside the call
                if self.policy.target == "cpu":
                    raise
                log.debug("%s: %s autocast simulation failed; using CPU's", n.name,
                          self.policy.target, exc_info=True)
            return self._in_autocast(n, args, kwargs, torch.device("cpu"))
        if n.op == "call_module" and d.inputs is not None:
            module = self.fetch_attr(n.target)
            params = {k: _cast(d.inputs)(p) for k, p in module.named_parameters()}
            return torch.func.functional_call(module, params, args, kwargs, strict=False)
        return getattr(self, n.op)(n.target, args, kwargs)


def _fake_inputs(mode: FakeTensorMode, example_inputs: tuple) -> tuple:
    return tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                    tuple(example_inputs))


def annotate(gm: fx.GraphModule, example_inputs: tuple, policy: Policy) -> PassResult:
    """Write ``node.meta["fxamp"]`` (and the value kind) on every node with a floating output."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {name: mode.from_tensor(t) for name, t in
                 list(gm.named_parameters(remove_duplicate=False))
                 + list(gm.named_buffers(remove_duplicate=False))}
        inputs = _fake_inputs(mode, example_inputs)
        home = (observe.device_of(tuple(example_inputs))
                or observe.device_of(list(state.values())) or torch.device("cpu"))
        sim = _Simulator(gm, policy, mode, home)
        # grad stays enabled, as in training: modules such as nn.MultiheadAttention take
        # the path they take when training (their inference fast path differs on fakes)
        with _reparametrize_module(gm, state, tie_weights=True, strict=False):
            sim.run(*inputs)
    for node in gm.graph.nodes:
        for key in (META, VALUE, SHAPE):
            node.meta.pop(key, None)
        if node.name not in sim.decisions:
            continue
        d, result = sim.decisions[node.name]
        tensor = first_float(result)
        if tensor is None:
            continue
        node.meta[META] = NodePrecision(
            dtype=tensor.dtype, rule=d.rule, reason=d.reason, op=d.label,
            module=module_path(node), inputs=d.inputs)
        node.meta[VALUE] = "tensor" if isinstance(result, torch.Tensor) else "seq"
        node.meta[SHAPE] = tuple(tensor.shape)
    return PassResult(gm, modified=False)
