"""Dynamic axes in the exported ONNX file: ``export_onnx(..., dynamic_shapes=...)``.

``dynamic_shapes`` means what it means to ``torch.export``: a dict keyed by the forward's
parameter names, or a tuple with one entry per positional input; an input's entry is None
(every axis static), a dict ``{axis: Dim}`` or a list with one entry per axis (None or an
int: static). ``"auto"`` is fxamp's default spec, the one the ``torch.export`` front end uses
(:func:`fxamp.frontends.aten.default_dynamic_shapes`): dim 0 (the batch) of every tensor
input, and dim 1 (the sequence) of integer inputs of two or more dimensions (token ids,
attention masks), as ``Dim.AUTO``.

The graph exported must itself take those sizes. A graph the ``torch.export`` front end
made with these axes symbolic (``RewriteConfig.make(frontend="export",
dynamic_shapes=...)``) is exported as it is. A graph traced for the example's sizes (a
deployment plan, ``target="tensorrt"``, is planned static) holds them as constants (a
``view`` to ``[2, 16, 2, 16]``): ``torch.export`` of it again would fix every axis. Such a
graph is made again from the model it was rewritten from, with the same config and the
dynamic shapes (:func:`dynamic_graph`), and its plan must keep the same FP32 islands;
otherwise, or where ``torch.export`` fixes an axis asked for, a :class:`DynamicShapesError`
says why and what to do. The file's axes are checked (:func:`check_file_axes`), and the
export's checks run at the example's sizes and at other sizes (:func:`other_shape`).
"""
from __future__ import annotations

import collections
import inspect
import logging
from typing import Any, Counter, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..frontends.aten import axes_of
from .errors import DynamicShapesError

log = logging.getLogger(__name__)

#: the spec asking for fxamp's default dynamic axes
AUTO = "auto"
#: the file's metadata key listing its dynamic axes (``input:axis,axis; ...``)
AXES_KEY = "fxamp.dynamic_axes"
#: (input index, axis) pairs
Axes = List[Tuple[int, int]]
#: the advice of an axis the model's code needs at the example's size
STATIC_ADVICE = ("what to do: leave that axis static (dynamic_shapes without it), or change "
                 "the model so it takes other sizes there")


def default_spec(inputs: tuple) -> Tuple[Any, ...]:
    """fxamp's default dynamic axes, one entry per input: dim 0 of every tensor of one or
    more dimensions, and dim 1 of integer tensors of two or more (token ids, masks).

    Args:
        inputs: the example's positional inputs.

    Returns:
        The positional ``dynamic_shapes`` (``Dim.AUTO`` entries).
    """
    return tuple(axes_of(value) for value in inputs)


def forward_names(module: torch.nn.Module, count: int) -> List[str]:
    """The names of the first ``count`` positional parameters of ``module.forward``."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds][:count]


def positional_spec(spec: Any, module: torch.nn.Module, inputs: tuple
                    ) -> Optional[Tuple[Any, ...]]:
    """``spec`` as one entry per positional input (None: no dynamic axes).

    Args:
        spec: None, ``"auto"`` (or True), a dict keyed by the forward's parameter names, or
            a tuple / list with one entry per input.
        module: the module exported (its forward names the inputs).
        inputs: the example's positional inputs.

    Returns:
        The tuple, or None.

    Raises:
        DynamicShapesError: a key naming no input, or a tuple of another length.
    """
    if spec is None or spec is False:
        return None
    if spec is True or (isinstance(spec, str) and spec == AUTO):
        return default_spec(inputs)
    if isinstance(spec, dict):
        names = forward_names(module, len(inputs))
        unknown = sorted(set(spec) - set(names))
        if unknown or len(names) != len(inputs):
            raise DynamicShapesError(
                f"dynamic_shapes names {', '.join(map(repr, unknown)) or 'inputs'} but the "
                f"exported forward takes {', '.join(map(repr, names)) or 'no named inputs'}; "
                "what to do: key dynamic_shapes by the forward's parameter names, or give a "
                "tuple with one entry per example input")
        return tuple(spec.get(name) for name in names)
    if isinstance(spec, (tuple, list)) and len(spec) == len(inputs):
        return tuple(spec)
    raise DynamicShapesError(
        f"dynamic_shapes must be None, 'auto', a dict keyed by the forward's parameter names "
        f"or a tuple with one entry per example input ({len(inputs)}), got {spec!r}; what to "
        "do: pass dynamic_shapes as torch.export takes it, e.g. {'input_ids': {0: "
        "Dim.AUTO, 1: Dim.AUTO}}")


def requested_axes(spec: Tuple[Any, ...]) -> Axes:
    """The (input index, axis) pairs ``spec`` asks to be dynamic (an entry that is neither
    None nor an int)."""
    axes: Axes = []
    for index, entry in enumerate(spec):
        if isinstance(entry, dict):
            pairs = entry.items()
        elif isinstance(entry, (list, tuple)):
            pairs = enumerate(entry)
        else:
            continue
        axes += [(index, int(axis)) for axis, dim in pairs
                 if dim is not None and not isinstance(dim, int)]
    return sorted(axes)


def _fixed_axes(gm: torch.nn.Module, axes: Axes) -> Axes:
    """The asked-for axes that ``gm``'s graph has traced at a fixed size (an ATen graph's
    placeholder holding an int there); a graph without shapes (the fx front end's) has
    none known."""
    if not isinstance(gm, fx.GraphModule):
        return []
    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    fixed: Axes = []
    for index, axis in axes:
        val = vals[index] if index < len(vals) else None
        if isinstance(val, torch.Tensor) and axis < val.dim() and \
                isinstance(val.shape[axis], int):
            fixed.append((index, axis))
    return fixed


def _islands(plan: Any) -> Counter[Tuple[str, str]]:
    """The plan's FP32 computing nodes, as a count of (module, op): what a plan made again
    with other shapes must keep (its node names may shift: shape arithmetic adds nodes)."""
    return collections.Counter(
        (p.module or "", str(p.op)) for p in plan.nodes.values()
        if p.dtype == torch.float32 and str(p.op) not in ("get_attr", "placeholder", "output")
        and "sym_size" not in str(p.op))


def _keyed(spec: Tuple[Any, ...], model: torch.nn.Module) -> Any:
    """The positional spec keyed by ``model``'s forward names (as the export front end
    binds its inputs); the tuple where the names cannot be told."""
    names = forward_names(model, len(spec))
    return dict(zip(names, spec)) if len(names) == len(spec) else spec


def dynamic_graph(gm: torch.nn.Module, inputs: tuple, spec: Tuple[Any, ...]
                  ) -> torch.nn.Module:
    """The graph to export with the dynamic axes of ``spec``: ``gm`` where its graph does
    not fix them, else a rewrite of the model ``gm`` was made from with ``gm``'s config and
    ``spec`` (the plan made again on the same example: its FP32 islands must be ``gm``'s).

    Args:
        gm: the rewritten module to export.
        inputs: the example's positional inputs.
        spec: the positional dynamic shapes.

    Returns:
        A module whose graph takes other sizes on those axes.

    Raises:
        DynamicShapesError: the graph fixes them and cannot be made again (no source model,
            torch.export refuses, or the plan made again differs).
    """
    fixed = _fixed_axes(gm, requested_axes(spec))
    if not fixed:
        return gm
    from ..result import config_of, plan_of, result_of
    from ..rewriter import amp_rewrite

    shown = ", ".join(f"dimension {axis} of input {index}" for index, axis in fixed)
    advice = ("what to do: rewrite with RewriteConfig.make(frontend='export', "
              "dynamic_shapes=...) (torch.export's spelling) and export that")
    structure = result_of(gm).structure
    source = getattr(structure, "model", None)
    if source is None or source is gm:
        raise DynamicShapesError(
            f"the rewritten graph was traced with {shown} fixed at the example's size and "
            f"the model it was made from is not known, so it cannot be traced again; {advice}")
    log.info("the rewritten graph fixes %s at the example's size: rewriting %s again with "
             "its config and the dynamic shapes", shown, type(source).__name__)
    config = config_of(gm).replace(frontend="export", dynamic_shapes=_keyed(spec, source))
    try:
        again = amp_rewrite(source, inputs, config=config)
    except Exception as err:  # noqa: BLE001 - torch.export's refusal, with its cause
        raise DynamicShapesError(
            f"the rewritten graph fixes {shown} at the example's size, and the model cannot "
            f"be traced again with them dynamic ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); {advice}, or export with "
            "dynamic_shapes=None (static)") from err
    if _islands(plan_of(again)) != _islands(plan_of(gm)):
        raise DynamicShapesError(
            f"the rewritten graph fixes {shown} at the example's size, and the plan made "
            "again with dynamic shapes keeps other nodes in FP32 than the module's plan (a "
            "plan changed after the rewrite: the search, an override, healing), so the file "
            f"would not follow the module's plan; {advice}, with the same policy")
    return again


def check_file_axes(proto: Any, names: Sequence[str], inputs: tuple, axes: Axes) -> None:
    """Raise DynamicShapesError where an asked-for axis of the file's inputs is fixed.

    Args:
        proto: the exported ``ModelProto``.
        names: the file's input names, one per example input.
        inputs: the example's positional inputs.
        axes: the (input index, axis) pairs asked to be dynamic.
    """
    dims = {i.name: i.type.tensor_type.shape.dim for i in proto.graph.input}
    fixed = [(index, axis) for index, axis in axes
             if index < len(names) and names[index] in dims
             and axis < len(dims[names[index]])
             and dims[names[index]][axis].HasField("dim_value")]
    if not fixed:
        return
    index, axis = fixed[0]
    size = inputs[index].shape[axis]
    hint = (" (torch.export fixes an axis whose example size is 0 or 1: give an example "
            "with size 2 or more there)" if size <= 1 else "")
    raise DynamicShapesError(
        f"the exported file fixes dimension {axis} of input {names[index]!r} at {size}, "
        f"which dynamic_shapes asks to be dynamic: torch.export specialised it, because the "
        f"model's code needs that size on the example (a shape checked against a constant, "
        f"a reshape to a fixed size){hint}. {STATIC_ADVICE}")


def axes_text(names: Sequence[str], axes: Axes) -> str:
    """The metadata form of the dynamic axes: ``input_ids:0,1; mask:0``."""
    by_input: Dict[int, List[int]] = {}
    for index, axis in axes:
        by_input.setdefault(index, []).append(axis)
    return "; ".join(f"{names[index] if index < len(names) else index}:"
                     f"{','.join(map(str, sorted(found)))}"
                     for index, found in sorted(by_input.items()))


def parse_axes(text: str, names: Sequence[str]) -> Axes:
    """The (input index, axis) pairs of :func:`axes_text`'s form, for inputs ``names``."""
    axes: Axes = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        name, _, found = part.rpartition(":")
        if name in names:
            axes += [(list(names).index(name), int(a)) for a in found.split(",") if a]
    return sorted(axes)


def _other_size(size: int, axis: int) -> int:
    """Another size for a dynamic axis: one more for the batch (dim 0); about half for
    another axis (a sequence: under any length limit the example met), at least 2."""
    if axis == 0:
        return size + 1
    other = size // 2 + 1
    return other if other >= 2 and other != size else size + 1


def resized(value: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """``value`` with ``axis`` of ``size``: its own values, cut along it or repeated, every
    other repeat of a floating tensor negated (new rows that differ from the example's);
    token ids stay in the vocabulary, masks stay masks."""
    have = value.shape[axis]
    if have == 0:
        raise DynamicShapesError(f"an example input has size 0 on dimension {axis}; what to "
                                 "do: export with an example of size 2 or more there")
    other = -value if value.is_floating_point() else value
    pieces = [other if i % 2 else value for i in range(-(-size // have))]
    return torch.cat(pieces, dim=axis).narrow(axis, 0, size)


def other_shape(inputs: tuple, axes: Axes) -> tuple:
    """The example at other sizes on every dynamic axis (:func:`_other_size`; two axes of
    one size get one new size, so dimensions the model needs equal stay equal).

    Args:
        inputs: the example's positional inputs.
        axes: the (input index, axis) pairs that are dynamic.

    Returns:
        The inputs at the new sizes.
    """
    sizes: Dict[Tuple[int, int], int] = {}
    out = list(inputs)
    for index, axis in axes:
        value = out[index]
        if not isinstance(value, torch.Tensor) or axis >= value.dim():
            continue
        old = inputs[index].shape[axis]
        new = sizes.setdefault((axis, old), _other_size(old, axis))
        out[index] = resized(value, axis, new)
    return tuple(out)


def shape_text(inputs: Any) -> str:
    """The inputs' shapes, ``2x16`` each, comma-separated."""
    return ", ".join("x".join(map(str, t.shape)) or "scalar" for t in inputs
                     if isinstance(t, torch.Tensor))
