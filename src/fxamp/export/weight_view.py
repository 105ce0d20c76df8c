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

from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

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


def _called(gm: fx.GraphModule) -> Set[str]:
    """The modules ``gm``'s graph calls or reads (the view shares them with the model)."""
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_module"
            or n.op == "get_attr" and isinstance(fetch_attr(gm, str(n.target)), nn.Module)}


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
    called = _called(gm)
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


#: the convolutions a BatchNorm module folds into (``F.conv2d`` is ``torch.conv2d``)
_CONVS = (torch.conv1d, torch.conv2d, torch.conv3d)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: the suffix of a folded weight's or bias's name
FOLDED = "_fxamp_folded"


#: ``F.batch_norm``'s parameters after its input, in order, with their defaults
_BN_PARAMS = (("running_mean", None), ("running_var", None), ("weight", None), ("bias", None),
              ("training", False), ("momentum", 0.1), ("eps", 1e-5))
#: reads of a tensor's metadata (the checks timm's norm layers trace), which a folded
#: convolution's output answers alike
_META_READS = frozenset({"ndim", "shape", "dtype", "device", "dim", "size"})


def _bn_values(view: fx.GraphModule, bn: fx.Node, sources: Dict[str, torch.Tensor]
               ) -> Optional[Dict[str, Any]]:
    """The inference BatchNorm ``bn`` applies, as FP32 tensors (``running_mean``,
    ``running_var``, ``weight`` and ``bias``, None where absent) and ``eps``: a call of an
    eval-mode BatchNorm module, or ``F.batch_norm(..., training=False)`` on attributes (an
    attribute the view holds cast: its FP32 source); None for anything else."""
    if bn.op == "call_module":
        module = view.get_submodule(str(bn.target))
        if len(bn.args) != 1 or bn.kwargs or type(module) not in _BATCHNORMS \
                or module.training:
            return None
        found = {"running_mean": module.running_mean, "running_var": module.running_var,
                 "weight": module.weight, "bias": module.bias, "eps": module.eps}
    elif bn.op == "call_function" and bn.target is F.batch_norm:
        values = dict(_BN_PARAMS)
        values.update(zip([k for k, _ in _BN_PARAMS], bn.args[1:]))
        values.update(bn.kwargs)
        if values["training"] is not False or isinstance(values["eps"], fx.Node):
            return None
        found = {"eps": values["eps"]}
        for key in ("running_mean", "running_var", "weight", "bias"):
            arg = values[key]
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                found[key] = sources.get(str(arg.target), fetch_attr(view, str(arg.target)))
            elif arg is None:
                found[key] = None
            else:
                return None
    else:
        return None
    tensors = [found[k] for k in ("running_mean", "running_var", "weight", "bias")]
    if found["running_mean"] is None or found["running_var"] is None or not all(
            t is None or (isinstance(t, torch.Tensor) and t.dtype == torch.float32)
            for t in tensors):
        return None
    return found


def _meta_read(node: fx.Node) -> bool:
    """Whether ``node`` only reads its input's metadata (``x.ndim``, ``x.size()``)."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _META_READS
    return node.op == "call_method" and node.target in _META_READS


def _foldable(view: fx.GraphModule, bn: fx.Node, sources: Dict[str, torch.Tensor]
              ) -> Optional[Tuple[fx.Node, fx.Node, Optional[fx.Node], Dict[str, Any]]]:
    """(conv, its weight's get_attr, its bias's or None, the BatchNorm's values) where ``bn``
    is an inference BatchNorm (:func:`_bn_values`) of the output of a convolution that
    nothing else reads but for its metadata, whose weight (and bias) the view reads cast
    from an FP32 source and nothing else reads; else None."""
    if not bn.args or not isinstance(bn.args[0], fx.Node):
        return None
    conv = bn.args[0]
    if not (conv.op == "call_function" and conv.target in _CONVS and len(conv.args) >= 2
            and all(u is bn or _meta_read(u) for u in conv.users)):
        return None
    values = _bn_values(view, bn, sources)
    if values is None:
        return None
    bias = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
    attrs = [conv.args[1]] + ([bias] if bias is not None else [])
    if not all(isinstance(a, fx.Node) and a.op == "get_attr" and str(a.target) in sources
               and len(a.users) == 1 for a in attrs):
        return None
    return conv, conv.args[1], bias, values


def fold_view_batchnorms(view: fx.GraphModule, sources: Dict[str, torch.Tensor]
                         ) -> List[Tuple[str, str]]:
    """Fold each inference BatchNorm of ``view`` (:func:`low_weights_view`; a module or
    ``F.batch_norm``) that reads a convolution alone into that convolution, before the
    exporter sees it: a BatchNorm costs
    the exporter as much as its Conv (ResNet-18's FP32 export: 1.12 s, 0.75 s with its 20
    BatchNorms folded), and the file folds it anyway. The folded weight and bias are computed
    from the FP32 sources by :func:`.fold.folded`, the arithmetic of the ONNX fold, and
    become new sources (named with :data:`FOLDED`), so the file holds them in FP32 behind a
    Cast and the weight-cast fold rounds them once, as it does the ONNX fold's. ``view``
    and ``sources`` change; the model does not. Returns (conv, BatchNorm) node names."""
    from .fold import folded

    done: List[Tuple[str, str]] = []
    called = _called(view)
    for bn in list(view.graph.nodes):
        found = _foldable(view, bn, sources)
        if found is None or _inside(str(found[1].target) + FOLDED, called):
            continue
        conv, weight, bias, values = found
        w32 = sources[str(weight.target)].cpu().numpy()
        channels = w32.shape[0]

        def array(key: str, fill: Any = np.zeros) -> Any:
            value = values[key]
            return fill(channels, np.float32) if value is None \
                else value.detach().cpu().numpy()

        new_w, new_b = folded(
            w32, sources[str(bias.target)].cpu().numpy() if bias is not None else None,
            array("weight", np.ones), array("bias"), array("running_mean"),
            array("running_var"), values["eps"])
        prefix = str(weight.target)[:-len("weight")] \
            if str(weight.target).endswith("weight") else str(weight.target) + "."
        low = fetch_attr(view, str(weight.target)).dtype
        names = []
        for value, name in ((new_w, str(weight.target) + FOLDED),
                            (new_b, prefix + "bias" + FOLDED)):
            sources[name] = torch.from_numpy(np.ascontiguousarray(value))
            _set_attr(view, name, sources[name].to(low))
            names.append(name)
        with view.graph.inserting_before(conv):
            w_node = view.graph.get_attr(names[0])
            b_node = view.graph.get_attr(names[1])
        args = list(conv.args) + [None] * (3 - len(conv.args))
        args[1], args[2] = w_node, b_node
        conv.args = tuple(args)
        conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "bias"}
        reads = [a for a in bn.all_input_nodes if a.op == "get_attr"]
        bn.replace_all_uses_with(conv)
        view.graph.erase_node(bn)
        for old in (weight, bias):
            if old is not None and not old.users:
                view.graph.erase_node(old)
                sources.pop(str(old.target), None)
        for old in reads:  # (F.batch_norm's parameters, read by it alone)
            if not old.users:
                view.graph.erase_node(old)
                sources.pop(str(old.target), None)
        done.append((conv.name, bn.name))
    if done:
        view.graph.lint()
        view.recompile()
    return done


def _set_attr(root: nn.Module, target: str, value: torch.Tensor) -> None:
    """Put ``value`` at dotted ``target`` under ``root`` as a parameter (as the view holds
    the weights), making the containers on the way (the view's own: the caller checks with
    :func:`_inside` that no module the view shares with the model is on the way)."""
    *path, name = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    setattr(module, name, nn.Parameter(value, requires_grad=False))


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
