"""Annotate pass: autocast's op lists for the target decide each node's precision.

For every node with a floating output it records the plan line (``NodePrecision``) in the IR
(``fxamp.ir``).
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
from .._torch import (DataDependentOutputException, DynamicOutputShapeException,
                      FakeTensorMode, reparametrize_module, tree_flatten, tree_map,
                      unset_fake_temporarily)

from .. import ir, ops
from ..ir import Decision, Rule
from ..errors import FxampError, UnsupportedModelError, node_error
from ..graph_run import GraphRun
from ..plan import NodePrecision
from ..policy import Policy, autocast_device, dtype_name
from ..runtime import device_autocast, eligible
from . import PassResult, observe
from .autocast_rules import decide, make_rules, module_path
from .manager import PassContext

log = logging.getLogger(__name__)



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


def computes_in(value: Any, inputs: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype a node whose output has no floating tensor computes in: the dtype of the
    real and imaginary parts of its first complex output (an FFT), else, when its output
    holds tensors (``linalg.matrix_rank``'s integers), its planned input dtype; None when
    there is nothing to say (sizes, Python numbers)."""
    leaves = [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]
    complex_ = next((leaf for leaf in leaves if leaf.is_complex()), None)
    if complex_ is not None:
        return complex_.dtype.to_real()
    return inputs if leaves else None


def first_float(value: Any) -> Optional[torch.Tensor]:
    """The first floating tensor in a (nested) value, or None."""
    leaves = float_leaves(value)
    return leaves[0] if leaves else None


def check_banned(gm: fx.GraphModule, ctx: Optional[PassContext] = None) -> PassResult:
    """Raise for any node still planned with a banned op (autocast refuses those too)."""
    for node in gm.graph.nodes:
        p = ir.precision(node)
        if p is not None and p.rule == Rule.BANNED:
            raise node_error(
                UnsupportedModelError, node, p.reason,
                "use binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss on logits, or "
                f"keep this node in FP32 with the policy override 'fp32:{node.name}'")
    return PassResult(gm, modified=False)


def _cast(dtype: Optional[torch.dtype]) -> Callable[[Any], Any]:
    def cast(value: Any) -> Any:
        if dtype is not None and eligible(value) and value.dtype != dtype:
            return value.to(dtype)
        return value
    return cast


_VALUE_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
_CALLS = ops.OP_NODES
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


class _Simulator(GraphRun):
    """Runs the source graph on fake tensors with the planned input casts applied.

    Each call the op tables leave to autocast is also run under real autocast of the target
    (``observe``); where the two differ in the casts made or the dtypes produced, autocast's
    observed behaviour is the decision."""

    def __init__(self, gm: fx.GraphModule, policy: Policy, fake_mode: FakeTensorMode,
                 home: torch.device, memo: Optional[Dict[fx.Node, Any]] = None,
                 scope: Any = None, inputs: tuple = ()) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.policy = policy
        self.fake_mode = fake_mode
        self.home = home
        self.decisions: Dict[str, Tuple[Decision, Any]] = {}
        #: the nodes with an input autocast would cast (floating, not float64)
        self.float_in: set = set()
        self.rules = make_rules(gm, policy, scope, inputs)
        # node -> (its first decision and the identities of its input values, (decision,
        # result)) from an earlier run of the same session: reused while both are unchanged
        self.memo: Dict[fx.Node, Any] = {} if memo is None else memo

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if any(eligible(v) for v in tree_flatten((args, kwargs))[0]):
            self.float_in.add(n.name)
        d = decide(n, self.rules, args, kwargs)
        key = (d, tuple(id(self.env[a]) for a in n.all_input_nodes))
        hit = self.memo.get(n)
        if hit is not None and hit[0] == key:  # same decision, same input values
            self.decisions[n.name] = hit[1]
            return hit[1][1]
        d, result = self._decide_and_run(n, d, args, kwargs)
        self.memo[n] = (key, (d, result))
        self.decisions[n.name] = (d, result)
        return result

    def _decide_and_run(self, n: fx.Node, d: Decision, args: tuple, kwargs: dict
                        ) -> Tuple[Decision, Any]:
        """Autocast's observed behaviour corrects the tables' decision ``d``; the node is run
        on fake tensors with the decided input casts. (final decision, fake result)"""
        params = (dict(self.fetch_attr(n.target).named_parameters())
                  if n.op == "call_module" else {})
        values = observe.float_inputs(args, kwargs, params)
        if d.rule == Rule.AUTOCAST and d.inputs is not None and values and not any(
                eligible(v) for v in values):
            d = Decision(None, Rule.AUTOCAST, "float64 inputs: torch.autocast leaves float64 "
                         "alone", d.label)
        obs = (self._observe(n, args, kwargs, params)
               if n.op in _CALLS and d.rule == Rule.AUTOCAST and not d.runtime else None)
        if obs is not None and obs.banned:
            d = Decision(None, Rule.BANNED, f"{d.label} is unsafe in "
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
                d = Decision(None, Rule.RUNTIME, f"torch.autocast({self.policy.target!r}) "
                             "casts inside this call, not only its inputs (observed): it "
                             "runs under torch.autocast at run time", d.label, runtime=True)
                try:
                    result, error = self._run(n, d, args, kwargs), None
                except Exception as err:  # noqa: BLE001
                    error = err
        if isinstance(error, FxampError):  # the call's own clear error (a buffer write)
            problem, _, fix = str(error).split("\n\nWhile executing")[0].partition(
                "; what to do: ")
            raise node_error(type(error), n, problem, fix or "see the problem above")
        if error is not None and not values:  # (no floating input: no cast is the cause)
            raise node_error(
                UnsupportedModelError, n,
                f"{d.label} fails on fxamp's trial run, which has no floating tensor input "
                f"to cast (so no planned dtype is the cause): {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}",
                "check that the model runs as it is with these inputs; if it does, this is a "
                "bug in fxamp: report it to fxamp with this node"
            ) from error
        if error is not None:
            raise node_error(
                UnsupportedModelError, n,
                f"{d.label} fails with the planned dtypes ({d.rule}: {d.reason}): "
                f"{type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}",
                "check that the model runs under torch.autocast for this target and dtype, "
                f"or keep the node in FP32 with the policy override 'fp32:{n.name}'"
            ) from error
        return d, result

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
        return Decision(dtype, Rule.AUTOCAST, f"torch.autocast({target!r}) {did} (observed; "
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
                return self._in_autocast(n, args, kwargs,
                                         torch.device(autocast_device(self.policy.target)))
            except Exception:  # noqa: BLE001 - e.g. CPU constants made inside the call
                if autocast_device(self.policy.target) == "cpu":
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


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object on ``tensor``'s data, with its ``requires_grad``: the fake of it
    is made without reading the model's tensor's ``.grad``, which another thread training
    the model may be setting (torch reads it unlocked: a crash, not an error)."""
    alone = tensor.detach()
    if tensor.requires_grad:
        alone.requires_grad_(True)
    return alone


class FakeSession:
    """One fake-tensor world per rewrite: the fake mode, the graph's parameters and inputs as
    fakes, and each node's fake result. Annotating again with the same session re-executes
    only the nodes whose decision or input values changed since the last run; the others
    keep their results (so the graph's fake run happens once, then only what changed)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: tuple) -> None:
        self.gm = gm
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        named = list(gm.named_parameters(remove_duplicate=False)) \
            + list(gm.named_buffers(remove_duplicate=False))
        alone: Dict[int, torch.Tensor] = {}  # (a tied weight: one fake for its names)
        for _, t in named:  # (outside the fake mode: a detach there is a fake dispatch)
            if id(t) not in alone:
                alone[id(t)] = _alone(t)
        with self.mode:
            self.state = {name: self.mode.from_tensor(alone[id(t)]) for name, t in named}
            self.inputs = _fake_inputs(self.mode, example_inputs)
        self.home = (observe.device_of(tuple(example_inputs))
                     or observe.device_of(list(self.state.values())) or torch.device("cpu"))
        self.memo: Dict[fx.Node, Any] = {}
        self.runs = 0  # runs over the graph (the first executes every node)


def annotate(gm: fx.GraphModule, example_inputs: tuple, policy: Policy,
             session: Optional[FakeSession] = None, scope: Any = None) -> PassResult:
    """Record the plan line, value kind and shape (``fxamp.ir``) of every node with a floating
    output. ``session`` (made for this ``gm``) reuses the fake results of earlier runs;
    ``scope``: the rewrite's override record (:class:`fxamp.overrides.Scope`)."""
    if session is None or session.gm is not gm:
        session = FakeSession(gm, example_inputs)
    session.runs += 1
    with session.mode:
        sim = _Simulator(gm, policy, session.mode, session.home, session.memo, scope,
                         session.inputs)
        # grad stays enabled, as in training: modules such as nn.MultiheadAttention take
        # the path they take when training (their inference fast path differs on fakes)
        with reparametrize_module(gm, session.state, tie_weights=True, strict=False):
            sim.run(*session.inputs)
    for node in gm.graph.nodes:
        ir.clear_annotation(node)
        if node.name not in sim.decisions:
            continue
        d, result = sim.decisions[node.name]
        tensor = first_float(result)
        if tensor is not None:
            dtype, value, shape = (tensor.dtype, "tensor" if isinstance(result, torch.Tensor)
                                   else "seq", tuple(tensor.shape))
        else:  # complex or integer results of floating inputs: their casts are planned too
            dtype = computes_in(result, d.inputs) if node.name in sim.float_in else None
            if dtype is None:
                continue
            value, shape = "other", None
        ir.set(node, precision=NodePrecision(
            dtype=dtype, rule=d.rule, reason=d.reason, op=d.label,
            module=module_path(node), inputs=d.inputs), value=value, shape=shape)
    return PassResult(gm, modified=False)
