"""The rewritten ATen graph as the ``ExportedProgram`` the ONNX exporter takes, without a
second ``torch.export``.

A model the ``torch.export`` front end took is planned on an ATen graph already: exporting
the rewritten graph again (what ``torch.onnx.export(graph_module)`` does) traces every op a
second time through ``torch.export``'s functionalization, for a graph that has nothing left
to capture. :func:`exported_program` builds the program from that graph directly: each
tensor the graph reads (``get_attr``) becomes a lifted parameter or buffer input, the
example inputs become the user inputs, each plan cast (``x.to(dtype)``) the ATen op
``_to_copy`` that ``torch.export`` would record for it, and a fake-tensor run over the graph
fills in every node's value (shape and dtype) for the exporter. The ONNX exporter's own
decomposition pass then runs on it, as on any exported program: the file is the one the
second export gave, node for node. The graph the plan was made on is the graph exported, and
each node keeps its name, so every plan decision still maps to its ONNX node.

fxamp's own run-time calls are what they are in an inference export: a ``fan_out`` is the
shared cast it hands on, a check nothing reads (input dtypes, range guards) is left out, as
is ``torch.export``'s input guard. A graph this does not fit otherwise (the fx front end's
Python-level graphs, other Python functions, calls kept opaque, subgraphs, non-tensor
inputs) gets None, and is exported as before.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec,
                                          OutputKind, OutputSpec, TensorArgument)
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .._torch import (TRAINING_VERIFIER, FakeTensorMode, OpOverload, graph_codegen,
                      is_input_guard, tree_flatten)
from ..ir import cast_dtype
from ..passes import fetch_attr
from ..runtime import check_input_dtypes, fan_out, range_guard

log = logging.getLogger(__name__)

#: fxamp's run-time checks a graph calls for their effect alone (nothing to export)
CHECKS = (check_input_dtypes, range_guard)


def _dropped(node: fx.Node) -> bool:
    """A node the program leaves out: the input guard, and run-time checks nothing uses."""
    return not node.users and (is_input_guard(node)  # (the export checks shapes itself)
                               or node.op == "call_function" and node.target in CHECKS)


def _shared(node: fx.Node) -> Optional[fx.Node]:
    """The shared cast a ``fan_out`` hands its consumer (what it returns without grad, as
    in an inference export), or None for any other node."""
    if node.op == "call_function" and node.target is fan_out and len(node.args) >= 3 \
            and isinstance(node.args[2], fx.Node) and set(node.kwargs) <= {"flat_linear"}:
        return node.args[2]
    return None


def _aten(target: object) -> bool:
    """Whether an exported program may call ``target``: an ATen op, or a Python operator on
    sizes (``operator.mul``, ``math.ceil``, ...)."""
    return isinstance(target, OpOverload) or \
        getattr(target, "__module__", None) in ("_operator", "math")


def _fits(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` is an ATen graph this module can hand over: calls of ATen ops, plan
    casts, reads of tensors, and what the program leaves out or hands on (``_dropped``,
    ``_shared``)."""
    for node in gm.graph.nodes:
        if _dropped(node) or _shared(node) is not None:
            continue
        if node.op == "call_function" and not _aten(node.target):
            return False  # (a function of fxamp's or the model's, kept in the graph)
        if node.op == "call_module" or \
                node.op == "call_method" and cast_dtype(node) is None:
            return False
        if node.op == "get_attr" and not isinstance(fetch_attr(gm, str(node.target)),
                                                     torch.Tensor):
            return False  # a subgraph (higher-order op) or a module
    return True


def _flat_inputs(gm: fx.GraphModule, inputs: tuple) -> Optional[List[torch.Tensor]]:
    """The example inputs in the order of ``gm``'s placeholders (its pytree input spec), or
    None where they are not all tensors or do not match that spec."""
    info = getattr(graph_codegen(gm.graph), "pytree_info", None)
    flat, spec = tree_flatten((tuple(inputs), {}))
    if info is None or info.in_spec != spec:
        return None
    if not all(isinstance(t, torch.Tensor) for t in flat):
        return None
    return flat


def exported_program(gm: fx.GraphModule, inputs: tuple
                     ) -> Optional[Tuple[ExportedProgram, Dict[str, str]]]:
    """``gm`` (an ATen graph from the ``torch.export`` front end, its casts included) as an
    ``ExportedProgram`` with static shapes of ``inputs``, and the program's node names ->
    ``gm``'s; None where the graph does not fit (see the module docstring).

    Args:
        gm: the graph to export (``low_weights_view`` of a rewritten model).
        inputs: the example inputs (the forward's positional arguments).

    Returns:
        The program and the name map, or None.
    """
    if not _fits(gm):
        return None
    flat = _flat_inputs(gm, inputs)
    if flat is None:
        return None
    info = graph_codegen(gm.graph).pytree_info
    graph = fx.Graph()
    mode = FakeTensorMode()
    env: Dict[fx.Node, fx.Node] = {}
    specs: List[InputSpec] = []
    state: Dict[str, torch.Tensor] = {}
    nodes = list(gm.graph.nodes)
    for node in (n for n in nodes if n.op == "get_attr"):  # lifted first, as export does
        target = str(node.target)
        value = fetch_attr(gm, target)
        new = env[node] = graph.placeholder(node.name)
        new.meta.update(node.meta)
        new.meta["val"] = mode.from_tensor(value)
        param = isinstance(value, torch.nn.Parameter)
        specs.append(InputSpec(InputKind.PARAMETER if param else InputKind.BUFFER,
                               TensorArgument(new.name), target, None if param else True))
        state[target] = value
    users = [n for n in nodes if n.op == "placeholder"]
    if len(users) != len(flat):
        return None
    for node, value in zip(users, flat):
        new = env[node] = graph.placeholder(node.name)
        new.meta.update(node.meta)
        new.meta["val"] = mode.from_tensor(value)
        specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(new.name), None))
    for node in nodes:
        if node in env or _dropped(node):
            continue
        if _shared(node) is not None:
            env[node] = env[_shared(node)]
            continue
        dtype = cast_dtype(node)
        if dtype is not None:
            new = graph.create_node("call_function", torch.ops.aten._to_copy.default,
                                    (env[node.args[0]],), {"dtype": dtype}, name=node.name)
            new.meta.update(node.meta)
        else:
            new = graph.node_copy(node, lambda arg: env[arg])
        env[node] = new
    renamed = {new.name: old.name for old, new in env.items() if _shared(old) is None}
    if any(k != v for k, v in renamed.items()):
        log.debug("exported program renamed nodes: %s",
                  {k: v for k, v in renamed.items() if k != v})
    output = next(n for n in graph.nodes if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (list, tuple)) or not all(isinstance(o, fx.Node) for o in outs):
        return None
    module = fx.GraphModule(gm, graph)
    with mode:
        FakeTensorProp(module, mode).propagate_dont_convert_inputs(
            *[n.meta["val"] for n in graph.nodes if n.op == "placeholder"])
    signature = ExportGraphSignature(
        specs, [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), None) for o in outs])
    calls = [ModuleCallEntry("", ModuleCallSignature(inputs=[], outputs=[],
                                                     in_spec=info.in_spec,
                                                     out_spec=info.out_spec))]
    program = ExportedProgram(module, graph, signature, state, {}, calls,
                              verifiers=[TRAINING_VERIFIER])
    return program, renamed
