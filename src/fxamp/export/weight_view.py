"""The graph the dynamo exporter is given: each weight already in the dtype the plan casts
it to, and the FP32 source put back behind a ``Cast`` in the ONNX file.

The rewritten graph casts each weight with ``Tensor.to`` on every call (as autocast does).
Exported as it is, every one of those casts is one more op for ``torch.export`` and the
exporter's decompositions to trace, with a metadata assertion each: on a CNN, half the
nodes they handle and half the export time. :func:`low_weights_view` gives the exporter a
copy of the graph reading, for each weight the graph only casts (to one dtype), that weight
cast once in PyTorch, under the same name; :func:`restore_weight_casts` then makes each such
initializer of the ONNX file its FP32 source again behind one ``Cast``, which is what the
exporter writes for the casting graph. Everything after the export (the BatchNorm and
constant folds from the FP32 values, the weight-cast fold) sees the file it always saw;
the values in the file are the same bit for bit. The model is not touched: the view holds
the model's own modules and the low-precision copies, and is dropped after the export.
"""
from __future__ import annotations

from typing import Any, Dict, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .. import ir
from .._torch import graph_codegen
from ..passes import fetch_attr

#: ONNX element types of the low dtypes a plan casts weights to
_ONNX_TYPE = {torch.float16: 10, torch.bfloat16: 16}
#: the suffix of the value a restored ``Cast`` writes
SUFFIX = "__fxamp_low"


def _only_cast_to(node: fx.Node) -> Any:
    """The one dtype every user of ``node`` is a plan cast to (``x.to(dtype)``), or None."""
    users = list(node.users)
    if not users or not all(ir.is_cast(u) and u.op == "call_method" and u.target == "to"
                            and len(u.args) == 2 and not u.kwargs for u in users):
        return None
    dtypes = {u.args[1] for u in users}
    return dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in _ONNX_TYPE else None


def _inside(target: str, called: Set[str]) -> bool:
    """Whether a module the graph calls or reads holds ``target`` (the view's root shares
    that module, so a copy put at ``target`` would land in the model's own module)."""
    parts = target.split(".")
    return any(".".join(parts[:i]) in called for i in range(1, len(parts)))


def low_weights_view(gm: fx.GraphModule) -> Tuple[fx.GraphModule, Dict[str, torch.Tensor]]:
    """A GraphModule computing what ``gm`` computes, whose graph reads each weight it only
    casts as that weight cast once (same name); and the FP32 sources, by name. Node names,
    meta and the code generator are ``gm``'s; the modules are ``gm``'s own."""
    graph = fx.Graph()
    graph.set_codegen(graph_codegen(gm.graph))
    env: Dict[fx.Node, fx.Node] = {}
    root: Dict[str, Any] = {}
    sources: Dict[str, torch.Tensor] = {}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"
              or n.op == "get_attr" and isinstance(fetch_attr(gm, str(n.target)), nn.Module)}
    for node in gm.graph.nodes:
        if node in env:  # a cast the view dropped
            continue
        new = graph.node_copy(node, lambda arg: env[arg])
        env[node] = new
        if node.op == "call_module":
            root[str(node.target)] = gm.get_submodule(str(node.target))
        elif node.op == "get_attr":
            target = str(node.target)
            value = fetch_attr(gm, target)
            dtype = _only_cast_to(node) if isinstance(value, torch.Tensor) else None
            if dtype is None or value.dtype not in (torch.float32, torch.float64) \
                    or _inside(target, called):
                root[target] = value
                continue
            with torch.no_grad():
                low = value.detach().to(dtype)
            root[target] = (nn.Parameter(low, requires_grad=False)
                            if isinstance(value, nn.Parameter) else low)
            sources[target] = value.detach()
            for user in node.users:
                env[user] = new
    view = fx.GraphModule(root, graph, type(gm).__name__)
    shared = {id(m) for m in gm.modules()}
    for module in view.modules():  # (the containers the view made: gm's mode)
        if id(module) not in shared:
            module.training = gm.training
    return view, sources


def _rename_inputs(graph: Any, renames: Dict[str, str]) -> None:
    """Every read of a name in ``renames`` in ``graph`` and its subgraphs made a read of
    its new name."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                _rename_inputs(attr.g, renames)
            for sub in attr.graphs:
                _rename_inputs(sub, renames)
    for out in graph.output:
        if out.name in renames:
            out.name = renames[out.name]


def restore_weight_casts(model: Any, sources: Dict[str, torch.Tensor]) -> int:
    """Each low-precision initializer of ``model`` with a source in ``sources`` made that
    FP32 source behind one ``Cast`` (the ONNX of a graph casting the weight); returns how
    many. Initializers the exporter renamed or folded are left as they are."""
    from onnx import helper, numpy_helper

    graph = model.graph
    low_types = set(_ONNX_TYPE.values())
    casts = []
    renames: Dict[str, str] = {}
    for init in graph.initializer:
        source = sources.get(init.name)
        if source is None or init.data_type not in low_types:
            continue
        name, to = init.name, init.data_type
        init.CopyFrom(numpy_helper.from_array(source.cpu().numpy(), name))
        low = renames[name] = name + SUFFIX
        casts.append(helper.make_node("Cast", [name], [low], to=to, name=f"{name}_cast"))
        graph.value_info.append(helper.make_tensor_value_info(low, to, list(source.shape)))
    if casts:
        _rename_inputs(graph, renames)
        nodes = casts + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
    return len(casts)
