"""ONNX graph repairs run after export (the metadata helpers: :mod:`fxamp.export.onnx_metadata`).

After export fxamp post-processes the graph (counts in metadata_props "fxamp.*"):

* weight casts: onnxscript folds constants only up to 8192 elements, so a real weight stays an
  FP32 initializer behind a runtime Cast; fxamp folds ``Cast(initializer)`` into an FP16
  initializer ("fxamp.folded_weight_casts", with the constant subgraphs
  :mod:`fxamp.export.constants` folded first).
* lost eps: onnxscript's ``x + 0 -> x`` rule matches constants with abs_tol=1e-8, so a
  hand-written norm's ``+ 1e-12`` is deleted even in FP32 (a zero row then gives NaN); fxamp
  puts the Add back ("fxamp.restored_eps_adds").
* type repair: the dynamo exporter's optimizer folds an inference BatchNorm into the
  preceding Conv and writes the folded weight and bias as FP32 initializers even where the
  Conv's input is FP16 (an invalid model: ONNX Runtime refuses to load it, seen with torch
  2.14.1 / onnxscript 0.7). Such an initializer is cast to the dtype of the node's activation
  input (folding happened in FP32, so this is one rounding) and the node is noted.
* eps: a zero FP16/BF16 scalar constant added before a Sqrt/Reciprocal/Div/Pow (an eps that
  underflowed) is replaced by the dtype's smallest normal; ``epsilon`` attributes equal to 0
  are set to 1e-5. Attributes are FP32 in ONNX, so LayerNorm's eps=1e-12 survives as 1e-12.
(Provenance, each node's "fxamp.fx_node" and "fxamp.module", is written by ``onnx_export``
with the helpers of ``onnx_metadata``.)
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List

import torch.fx as fx

from .onnx_metadata import FX_NODE_RE, NOTE, get_meta, set_meta
from .onnx_types import ONNX_FLOAT_NAMES

log = logging.getLogger(__name__)

_EPS_CONSUMERS = {"Sqrt", "Reciprocal", "Div", "Pow"}


def _without_weights(model: Any) -> Any:
    """A copy of ``model`` whose initializers are graph inputs of their type and shape: what
    type inference reads of them (shape inference serializes the model it is given, weights
    and all, for each call: on a CNN that was most of its time)."""
    import onnx
    from onnx import helper

    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph, source = light.graph, model.graph
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    inputs = {i.name for i in source.input}
    graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                       for i in source.initializer if i.name not in inputs)
    return light


def value_types(model: Any) -> Dict[str, int]:
    """Element type of every value (after ONNX type inference, on the model without its
    weights' data)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(_without_weights(model),
                                                     strict_mode=False)
    except Exception as err:  # noqa: BLE001 - inference is best effort
        log.debug("shape inference failed: %s", err)
        inferred = model
    graph = inferred.graph
    types: Dict[str, int] = {}
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = attr.t.data_type
    return types


_SAME_TYPE_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub", "Mul", "Div",
                  "BatchNormalization", "LayerNormalization", "InstanceNormalization",
                  "GroupNormalization", "PRelu"}


def repair_types(model: Any) -> int:
    """Cast initializers whose float type disagrees with the node's first (activation) input.

    Returns how many initializers were changed."""
    from onnx import numpy_helper

    floats = {1, 10, 16}
    inits = {i.name: i for i in model.graph.initializer}
    types = value_types(model)
    uses: Dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    changed = 0
    for node in model.graph.node:
        if node.op_type not in _SAME_TYPE_OPS or not node.input:
            continue
        want = types.get(node.input[0])
        if want not in floats or node.input[0] in inits:
            continue
        fixed: List[str] = []
        old = ""
        for name in node.input[1:]:
            init = inits.get(name)
            if init is None or init.data_type not in floats or init.data_type == want:
                continue
            if node.op_type in ("BatchNormalization", "LayerNormalization") and name in (
                    node.input[3:] if node.op_type == "BatchNormalization" else ()):
                continue
            old = ONNX_FLOAT_NAMES.get(init.data_type, "?")
            array = numpy_helper.to_array(init)
            if uses.get(name, 0) > 1:  # shared: read a copy in this type (one per type:
                copy = f"{name}_fxamp_{want}"  # the exporter shares equal initializers,
                if copy not in inits:  # two blocks' fresh norm weights, say)
                    new = numpy_helper.from_array(astype(array, want), copy)
                    model.graph.initializer.append(new)
                    inits[copy] = new
                node.input[list(node.input).index(name)] = copy
            else:
                init.CopyFrom(numpy_helper.from_array(astype(array, want), name))
                for value in model.graph.value_info:  # the exporter's type of the old value
                    if value.name == name and value.type.HasField("tensor_type"):
                        value.type.tensor_type.elem_type = want
            changed += 1
            fixed.append(name)
        if fixed:
            rule = get_meta(node, "pkg.onnxscript.rewriter.rule_name")
            why = f" by {rule}" if rule else ""
            set_meta(node, NOTE, (get_meta(node, NOTE) or "") +
                      f"the exporter's optimizer{why} left {', '.join(fixed)} in {old}; fxamp "
                      f"cast {'them' if len(fixed) > 1 else 'it'} to "
                      f"{ONNX_FLOAT_NAMES.get(want, want)}. ")
    return changed


def fold_weight_casts(model: Any) -> int:
    """Cast(initializer) -> an initializer of the cast's type.

    The exporter's constant folding skips tensors over 8192 elements (onnxscript's default
    limit), so real weights stay FP32 initializers behind a runtime Cast; fxamp folds them so
    the file holds FP16 weights (the FP32 one is dropped when nothing else reads it)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    folded, keep = 0, []
    for node in model.graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        src = inits.get(node.input[0]) if node.op_type == "Cast" and node.input else None
        if (src is None or to not in (1, 10, 16) or src.data_type not in (1, 10, 16, 11)
                or node.output[0] in graph_outputs):
            keep.append(node)
            continue
        new = numpy_helper.from_array(astype(numpy_helper.to_array(src), to), node.output[0])
        model.graph.initializer.append(new)
        inits[new.name] = new
        folded += 1
    if folded:
        del model.graph.node[:]
        model.graph.node.extend(keep)
        used = {i for n in model.graph.node for i in n.input} | graph_outputs
        alive = [i for i in model.graph.initializer if i.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(alive)
    return folded


def restore_tiny_adds(model: Any, ep: Any) -> int:
    """Put back ``x + eps`` additions the exporter's optimizer deleted.

    onnxscript's no-op rule ``x + 0 -> x`` compares constants with abs_tol=1e-8, so an eps of
    1e-12 added in tensor arithmetic (a hand-written RMSNorm) is removed, even in FP32: a zero
    row then gives rsqrt(0) = inf and NaN. For each such add of the exported program whose
    output value is missing from the ONNX graph, an Add of the same constant is inserted before
    the nodes that read it (matched by the exporter's value names and fx_node metadata)."""
    import numpy as np
    from onnx import helper, numpy_helper

    outputs = {o for n in model.graph.node for o in n.output}
    types = None
    restored = 0
    for ep_node in ep.graph.nodes:
        name = getattr(ep_node.target, "__name__", "")
        if ep_node.op != "call_function" or not name.startswith("add.") or \
                len(ep_node.args) < 2 or not isinstance(ep_node.args[1], float):
            continue
        eps, src = ep_node.args[1], ep_node.args[0]
        if not 0.0 < abs(eps) < 1e-6 or ep_node.name in outputs or \
                not isinstance(src, fx.Node):
            continue
        users = {u.name for u in ep_node.users}
        readers = []
        for node in model.graph.node:
            text = get_meta(node, "pkg.torch.onnx.fx_node") or ""
            match = FX_NODE_RE.match(text)
            if match and match.group(1) in users and src.name in node.input:
                readers.append(node)
        if not readers:
            log.warning("the exporter removed `%s + %g` and fxamp could not put it back",
                        src.name, eps)
            continue
        if types is None:
            types = value_types(model)
        dtype = types.get(src.name, 1)
        value = astype(np.array(eps, dtype=np.float32), dtype)
        note = ""
        if float(value) == 0.0:
            value = astype(np.array(2.0 ** -14 if dtype == 10 else 2.0 ** -126,
                                     dtype=np.float32), dtype)
            note = " (0 in this dtype: set to its smallest normal)"
        const = f"{ep_node.name}_fxamp_eps"
        model.graph.initializer.append(numpy_helper.from_array(value, const))
        add = helper.make_node("Add", [src.name, const], [ep_node.name],
                               name=f"node_{ep_node.name}")
        set_meta(add, "pkg.torch.onnx.fx_node", f"%{ep_node.name} : restored by fxamp")
        set_meta(add, NOTE, f"the exporter's optimizer removed this + {eps:g} (it treats "
                  f"|c| < 1e-8 as 0); fxamp put it back{note}. ")
        for reader in readers:
            for i, inp in enumerate(reader.input):
                if inp == src.name:
                    reader.input[i] = ep_node.name
        nodes = list(model.graph.node)
        at = min(nodes.index(r) for r in readers)
        nodes.insert(at, add)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        restored += 1
    return restored


def astype(array: Any, onnx_type: int) -> Any:
    """``array`` in ONNX float type ``onnx_type`` (FP16 10, FP32 1, else BF16), rounded to
    nearest even once. A large writable FP32 array goes to FP16 through torch, whose
    vectorised conversion gives numpy's bits (overflow to inf, subnormals included) in under
    half its time."""
    import numpy as np

    if onnx_type == 10:
        if isinstance(array, np.ndarray) and array.dtype == np.float32 \
                and array.size > 4096 and array.flags.writeable:
            import torch  # (from_numpy takes writable arrays only)

            return torch.from_numpy(np.ascontiguousarray(array)).to(torch.float16).numpy()
        return array.astype(np.float16)
    if onnx_type == 1:
        return array.astype(np.float32)
    import ml_dtypes  # bf16: onnx depends on ml_dtypes

    return array.astype(ml_dtypes.bfloat16)


def fix_eps(model: Any) -> int:
    """Zero low-precision eps constants (and zero ``epsilon`` attributes) made non-zero."""
    import numpy as np
    from onnx import numpy_helper

    fixed = 0
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name in ("epsilon", "eps") and attr.type == attr.FLOAT and attr.f == 0.0:
                attr.f = 1e-5
                set_meta(node, NOTE, (get_meta(node, NOTE) or "") + "epsilon was 0; set "
                          "to 1e-5 by fxamp. ")
                fixed += 1
    consumers: Dict[str, List[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    tensors: Dict[str, Any] = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    tensors[node.output[0]] = attr.t
    for name, tensor in tensors.items():
        if tensor.data_type not in (10, 16):
            continue
        array = numpy_helper.to_array(tensor)
        if array.size != 1 or float(array.reshape(-1)[0]) != 0.0:
            continue
        for add in consumers.get(name, []):
            if add.op_type != "Add":
                continue
            if not any(c.op_type in _EPS_CONSUMERS for c in consumers.get(add.output[0], [])):
                continue
            tiny = np.float16(2.0 ** -14) if tensor.data_type == 10 else np.float32(2.0 ** -126)
            new = numpy_helper.from_array(astype(np.full(array.shape, tiny, np.float32),
                                                  tensor.data_type), tensor.name)
            tensor.CopyFrom(new)
            set_meta(add, NOTE, (get_meta(add, NOTE) or "") + f"eps {name} was 0 in "
                      f"{ONNX_FLOAT_NAMES[tensor.data_type]}; set to the smallest normal by "
                      "fxamp. ")
            fixed += 1
            break
    return fixed
