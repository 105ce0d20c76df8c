"""Casts pass: reads the IR (``fxamp.ir``) and builds the explicit mixed-precision graph.

Each node whose plan names an input dtype gets its floating inputs cast to it (one cast per
value and dtype, reused by every consumer until the value is changed in place). Leaf modules
whose parameters must be cast become functional calls on cast parameters (``F.linear``,
``F.conv2d`` ...) so every weight is cast once per forward; the FP32 Parameters stay shared with
the original model. Opaque calls run under ``torch.autocast`` (``rule="runtime"``).
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Dict, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .._torch import graph_codegen
from ..policy import Policy, dtype_name, is_deploy
from .. import runtime, weight_cache
from ..program import Program
from ..runtime import has_call_hooks, is_grad_mode_node
from . import PassResult
from .. import ir, ops
from ..ir import Rule
from .manager import PassContext
from .ranges import DEPLOY_MARGIN, MARGIN

log = logging.getLogger(__name__)
_GRAPHS = itertools.count(1)  # a token per built graph (the range guard's warn-once key)


_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_CONV_T = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
           nn.ConvTranspose3d: F.conv_transpose3d}


def _functional_form(module: nn.Module, n_args: int, has_kwargs: bool) -> Optional[Tuple]:
    """(function, extra positional args after the params) for simple leaf modules, else None."""
    cls = type(module)
    if has_kwargs or n_args != 1 or has_call_hooks(module):
        return None  # (a hooked module is called, so that its hooks run)
    if cls is nn.Linear:
        return F.linear, ()
    if cls in _CONV and module.padding_mode == "zeros":
        return _CONV[cls], (module.stride, module.padding, module.dilation, module.groups)
    if cls in _CONV_T and module.padding_mode == "zeros":
        return _CONV_T[cls], (module.stride, module.padding, module.output_padding,
                              module.groups, module.dilation)
    if cls is nn.PReLU:
        return F.prelu, ()
    return None


def mutated_source(node: fx.Node, root: nn.Module) -> Optional[fx.Node]:
    """The value ``node`` changes in place (its first argument or its ``out=``), if any."""
    out = node.kwargs.get("out")
    if isinstance(out, (list, tuple)):
        out = next((o for o in out if isinstance(o, fx.Node)), None)
    if isinstance(out, fx.Node):
        return out
    if node.args and isinstance(node.args[0], fx.Node) and _mutates_first_arg(node, root):
        return node.args[0]
    return None


def _mutates_first_arg(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(node.target), "inplace", False))
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return bool(node.kwargs.get("inplace")) or (name.endswith("_") and
                                                    not name.startswith("__"))
    return False


class _Builder:
    """Copies the source graph into a new one, inserting casts as the plan says."""

    def __init__(self, src: fx.GraphModule, policy: Policy) -> None:
        self.src, self.policy = src, policy
        self.graph = fx.Graph()
        self.env: Dict[fx.Node, fx.Node] = {}
        self.casts: Dict[Tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.params: Dict[int, fx.Node] = {}
        self.n_casts = 0
        self.reserved = {n.name for n in src.graph.nodes}
        # weights=o2: weight casts go through a WeightCache the optimizer step re-casts
        # (fxamp/weight_cache.py); otherwise each weight is cast in the graph, as autocast does
        self.cache = weight_cache.WeightCache() if policy.weights == "o2" else None
        self.cache_node: Optional[fx.Node] = None
        # the source nodes whose dtype is a region's plan's, known at run time: a region's
        # outputs, and what ops that follow their inputs' dtypes (an add, a residual) make of
        # them; every cast of them is kept (a no-op where the plan's dtype holds)
        self.from_regions: Set[fx.Node] = set()

    def name(self, candidate: str) -> str:
        """A name for an inserted node that no source node has."""
        while candidate in self.reserved:
            candidate += "_"
        return candidate

    # -- casts -----------------------------------------------------------------------
    def cast(self, value: fx.Node, src: fx.Node, dtype: torch.dtype) -> fx.Node:
        """``value`` (the copy of ``src``) cast to ``dtype``, made once."""
        record = ir.get(src)
        plan, kind = record.precision, record.value
        if plan is None or kind is None or kind == "other":  # (complex: autocast casts none)
            return value
        if kind == "tensor" and (plan.dtype == dtype or plan.dtype == torch.float64) \
                and src not in self.from_regions:
            return value
        held = ops.fetch_attr(self.src, str(value.target)) if value.op == "get_attr" else None
        if kind == "tensor" and isinstance(held, nn.Parameter):  # (tied: cast once)
            return self.param(str(value.target), held, dtype, value)
        key = (value, dtype)
        if key not in self.casts:
            name = self.name(f"{value.name}_{dtype_name(dtype)}")
            if kind == "tensor":
                node = self.graph.create_node("call_method", "to", (value, dtype), {}, name)
            else:
                node = self.graph.create_node("call_function", runtime.cast_tree,
                                              (value, dtype), {}, name)
            ir.mark_cast(node)
            node.meta["stack_trace"] = src.meta.get("stack_trace")
            self.casts[key] = node
            self.n_casts += 1
        return self.casts[key]

    def param(self, qualname: str, tensor: torch.Tensor, dtype: Optional[torch.dtype],
              node: Optional[fx.Node] = None) -> fx.Node:
        """A get_attr of a parameter (one per Parameter object; ``node`` when the graph has
        it already), cast to ``dtype``."""
        node = node or self.params.get(id(tensor))
        if node is None:
            node = self.graph.create_node("get_attr", qualname, (), {},
                                          self.name(qualname.replace(".", "_")))
            self.params[id(tensor)] = node
        if dtype is None or not runtime.eligible(tensor) or tensor.dtype == dtype:
            return node  # (float64 too: autocast leaves it alone)
        key = (node, dtype)
        if key not in self.casts:
            name = self.name(f"{node.name}_{dtype_name(dtype)}")
            if self.cache is not None:
                if self.cache_node is None:
                    self.cache_node = self.graph.create_node(
                        "get_attr", weight_cache.SUBMODULE, (), {},
                        self.name(weight_cache.SUBMODULE))
                cast = weight_cache.cast_node(self.graph, self.cache_node, self.cache, node,
                                              dtype, name, tensor)
            else:
                cast = self.graph.create_node("call_method", "to", (node, dtype), {}, name)
            ir.mark_cast(cast)
            self.casts[key] = cast
            self.n_casts += 1
        return self.casts[key]

    def mapped(self, node: fx.Node, dtype: Optional[torch.dtype]) -> Any:
        """``node``'s args and kwargs in the new graph, floating inputs cast to ``dtype``."""
        def transform(arg: fx.Node) -> fx.Node:
            value = self.env[arg]
            return value if dtype is None else self.cast(value, arg, dtype)
        return (fx.node.map_arg(node.args, transform), fx.node.map_arg(node.kwargs, transform))

    # -- nodes -----------------------------------------------------------------------
    def copy(self, node: fx.Node) -> fx.Node:
        plan = ir.precision(node)
        dtype = plan.inputs if plan is not None else None
        if node.op == "output":
            return self.output(node)
        args, kwargs = self.mapped(node, dtype)
        if ir.get(node).region or dtype is None and any(
                arg in self.from_regions for arg in node.all_input_nodes):
            self.from_regions.add(node)
        if plan is not None and plan.rule == Rule.RUNTIME and not ir.get(node).region:
            new = self.runtime_call(node, args, kwargs)
        elif node.op == "call_module" and ir.get(node).region:
            new = self.graph.create_node("call_function", runtime.region_call,
                                         (self.module_ref(node), dtype_name(self.policy.compute),
                                          *args), kwargs, node.name)
        elif node.op == "call_module" and dtype is not None and self._needs_param_casts(
                node, dtype):
            new = self.module_call(node, args, kwargs, dtype)
        else:
            new = self.graph.create_node(node.op, node.target, args, kwargs, node.name,
                                         node.type)
        new.meta.update(node.meta)
        changed = mutated_source(node, self.src)
        if changed is not None:
            self.forget_casts(changed)
        if is_grad_mode_node(node):
            self.casts.clear()  # a cast made under no_grad must not be reused outside it
        return new

    def forget_casts(self, changed: fx.Node) -> None:
        """After an in-place op, cached casts may hold stale values (the mutated tensor may
        be a view of others): drop the casts of activations, and of parameters too when the
        mutated value comes from a get_attr."""
        root = changed
        while root.args and isinstance(root.args[0], fx.Node) and root.op != "get_attr":
            root = root.args[0]
        everything = root.op == "get_attr"
        for key in [k for k in self.casts if everything or k[0].op != "get_attr"]:
            del self.casts[key]

    def _needs_param_casts(self, node: fx.Node, dtype: torch.dtype) -> bool:
        module = self.src.get_submodule(node.target)
        return any(runtime.eligible(p) and p.dtype != dtype for p in module.parameters())

    def module_call(self, node: fx.Node, args: tuple, kwargs: dict,
                    dtype: torch.dtype) -> fx.Node:
        module = self.src.get_submodule(node.target)
        form = _functional_form(module, len(args), bool(kwargs))
        named = dict(module.named_parameters())
        if form is not None:
            fn, extra = form
            weight = self.param(f"{node.target}.weight", module.weight, dtype)
            tensors = [weight]
            if fn is not F.prelu:
                bias = module.bias
                tensors.append(None if bias is None else
                               self.param(f"{node.target}.bias", bias, dtype))
            return self.graph.create_node("call_function", fn,
                                          (args[0], *tensors, *extra), {}, node.name)
        params = {k: self.param(f"{node.target}.{k}", p, dtype) for k, p in named.items()}
        module_node = self.module_ref(node)
        return self.graph.create_node("call_function", runtime.call_with_params,
                                      (module_node, params, *args), kwargs, node.name)

    def module_ref(self, node: fx.Node) -> fx.Node:
        return self.graph.create_node("get_attr", str(node.target), (), {},
                                      self.name(f"{node.name}_module"))

    def runtime_call(self, node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
        low = self.policy.compute
        if node.op == "call_module":
            module_node = self.module_ref(node)
            return self.graph.create_node("call_function", runtime.autocast_module,
                                          (module_node, dtype_name(low), *args), kwargs,
                                          node.name)
        fn = (node.target if node.op == "call_function"
              else getattr(torch.Tensor, str(node.target)))  # a tensor method: self first
        wrapper = runtime.autocast_wrapper(fn, low, ir.precision(node).op)
        return self.graph.create_node("call_function", wrapper, args, kwargs, node.name)

    def channels_last(self, value: fx.Node) -> fx.Node:
        """``value`` (a 4-D input) made contiguous in channels_last memory format."""
        node = self.graph.create_node("call_method", "contiguous", (value,),
                                      {"memory_format": torch.channels_last},
                                      self.name(f"{value.name}_channels_last"))
        ir.mark_cast(node)
        return node

    def output(self, node: fx.Node) -> fx.Node:
        out_dtype = self.policy.output_dtype

        def transform(arg: fx.Node) -> fx.Node:
            value = self.env[arg]
            if out_dtype is None or _converts_itself(arg):
                return value  # (an output the model converts keeps the model's dtype)
            return self.cast(value, arg, out_dtype)
        args = fx.node.map_arg(node.args, transform)
        return self.graph.create_node("output", "output", args, {}, node.name, node.type)


_CONVERSIONS = {"half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def _converts_itself(node: fx.Node) -> bool:
    """Whether ``node`` is the model's own conversion of a value to a dtype other than
    float32 (``y.half()``, ``y.to(torch.float8_e4m3fn)``, ``aten._to_copy(dtype=...)``):
    its output keeps that dtype under ``output=fp32``, as in the FP32 model."""
    if node.op not in ("call_method", "call_function") or ir.is_cast(node):
        return False
    name = ops.name(node)
    if name in _CONVERSIONS and node.op == "call_method":
        return True
    if name not in ("to", "type", "_to_copy"):
        return False
    dtypes = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
    return bool(dtypes) and dtypes[0] != torch.float32


def _guarded(src: fx.GraphModule, ctx: PassContext) -> Dict[fx.Node, Tuple[float, float]]:
    """The nodes the policy ``guard=on`` checks at run time, with (limit, largest value
    seen): those planned low precision whose range the ranges rule measured."""
    low, stats = ctx.policy.compute, ctx.ranges or {}
    limit = torch.finfo(low).max / (DEPLOY_MARGIN if is_deploy(ctx.policy.target) else MARGIN)
    out = {}
    for node in src.graph.nodes:
        plan, record = ir.precision(node), ir.get(node)
        if node.name in stats and plan is not None and plan.dtype == low \
                and record.value == "tensor":
            out[node] = (limit, stats[node.name].max_abs)
    return out


def _check_inputs(graph: fx.Graph, src: fx.GraphModule) -> None:
    """Make every call (each one, not only the first: the check is a node of the graph)
    refuse a floating input of a dtype that autocast treats otherwise than the example's
    (``runtime.check_input_dtypes``): the plan's casts hold only for inputs of the
    example's autocast class (float16 / bfloat16 / float32 alike, float64 as
    itself). Checked are the tensor placeholders that had a floating dtype in the example,
    whether the graph casts them directly or values computed from them."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    src_inputs = {n.name: n for n in src.graph.nodes if n.op == "placeholder"}
    planned = {name: ir.precision(n) for name, n in src_inputs.items()}
    floating = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    checked = [p for p in inputs if planned.get(p.name) is not None
               and planned[p.name].dtype in floating
               and ir.get(src_inputs[p.name]).value == "tensor"]
    if not checked:
        return
    with graph.inserting_after(inputs[-1]):
        graph.create_node("call_function", runtime.check_input_dtypes,
                          (tuple(checked), tuple(planned[p.name].dtype for p in checked),
                           tuple(str(p.target) for p in checked)), {}, "fxamp_check_inputs")


def _fan_out(graph: fx.Graph, root: nn.Module) -> int:
    """An activation cast to several consumers feeds each through ``runtime.fan_out``: one
    cast without grad; where autograd tracks the source, a cast per consumer, as autocast
    casts per op, so the gradients are summed at the source in its dtype, not in the
    cast's (the generated code makes the shared cast with ``runtime.shared_cast``). A
    consumer that changes its input in place keeps the cast itself (a custom Function's
    view cannot be modified in place). Returns the fan-out nodes made."""
    made = 0
    for cast in list(graph.nodes):
        if not (cast.op == "call_method" and cast.target == "to" and ir.is_cast(cast)):
            continue
        users = [u for u in cast.users if mutated_source(u, root) is not cast]
        if len(users) < 2 or cast.args[0].op == "get_attr":
            continue  # (a weight is a leaf: shared as is, as autocast's cast cache does)
        source, dtype = cast.args[0], cast.args[1]
        for user in users:
            args = (source, dtype, cast) + ((True,) if _flat_linear(user, cast, root) else ())
            with graph.inserting_before(user):
                node = graph.create_node("call_function", runtime.fan_out, args, {},
                                         f"{cast.name}_for_{user.name}")
            ir.mark_cast(node)
            node.meta["stack_trace"] = cast.meta.get("stack_trace")
            user.replace_input_with(cast, node)
            made += 1
    return made


def _flat_linear(user: fx.Node, cast: fx.Node, root: nn.Module) -> bool:
    """Whether ``user`` is a linear with a bias whose input is ``cast``: under torch.func such
    a linear runs on a flattened view of a 3-D input (``runtime.fan_out``)."""
    if ops.is_module(user, root, nn.Linear):
        return user.args[:1] == (cast,) and ops.module_of(user, root).bias is not None
    if user.op != "call_function" or "linear" not in (ops.name(user), ops.aten_name(user)):
        return False
    bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
    first = user.args[0] if user.args else user.kwargs.get("input")
    return first is cast and bias is not None


def insert_casts(src: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Build the rewritten graph, a :class:`~fxamp.program.Program` (sharing ``src``'s
    submodules and Parameters); what runs around it on each call is the Program's."""
    policy = ctx.policy
    builder = _Builder(src, policy)
    # the inputs the layout pass marked are converted to channels_last on entry
    pending = [n for n in src.graph.nodes
               if n.op == "placeholder" and ir.get(n).layout == "channels_last"]
    last_input = [n for n in src.graph.nodes if n.op == "placeholder"][-1] if pending else None
    guarded = _guarded(src, ctx) if policy.guard else {}
    token = next(_GRAPHS)  # (the guard warns once per graph)
    for node in src.graph.nodes:
        builder.env[node] = builder.copy(node)
        if node in guarded:  # (policy guard=on: the value checked against its range)
            limit, seen = guarded[node]
            builder.graph.create_node("call_function", runtime.range_guard,
                                      (builder.env[node], limit, node.name, seen,
                                       token), {},
                                      builder.name(f"{node.name}_guard"))
        if builder.env[node].name != node.name:
            raise RuntimeError(f"fxamp internal error: node {node.name!r} was renamed "
                               f"{builder.env[node].name!r}")
        if node is last_input:  # convert after all the placeholders
            for placeholder in pending:
                builder.env[placeholder] = builder.channels_last(builder.env[placeholder])
    _fan_out(builder.graph, src)
    _check_inputs(builder.graph, src)
    builder.graph.set_codegen(graph_codegen(src.graph))
    if builder.cache_node is not None:
        setattr(src, weight_cache.SUBMODULE, builder.cache)  # GraphModule() copies it from src
    gm = Program(src, builder.graph, type(src).__name__)
    log.debug("inserted %d casts", builder.n_casts)
    return PassResult(gm, modified=builder.n_casts > 0)
