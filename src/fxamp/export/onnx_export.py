"""export_onnx: the rewritten GraphModule to an FP16 ONNX model that follows its plan.

The default exporter of torch (``torch.onnx.export(..., dynamo=True)``, which needs onnxscript)
runs first; if it fails the TorchScript exporter (``dynamo=False``) is tried. Which one made the
file is stored in the model's ``metadata_props`` ("fxamp.exporter"), with the plan's text
("fxamp.plan") so a report can be made from the file alone.

The dynamo exporter's graph is taken unoptimised; the steps run on the exported file are
declared in ``fxamp.export.onnx_passes`` (``ONNX_STEPS``: BatchNorm and constant folds from
the FP32 values, each weight rounded once, onnxscript's optimizer, the weight-cast fold,
repairs, Cast pairs); then every node gets its provenance (the plan node, the module) and the
file its metadata (``fxamp.export.onnx_metadata``).

What is exported is one graph (``overlap.one_graph``): a model rewritten in place exports the
graph it computes with, and a model in block mode (its blocks' graphs called from its own
code under autocast, ``rewriter/blocks.py``) a flat rewrite of its FP32 form with its config,
made on the example inputs; the model keeps its rewrite.
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import tempfile
import types
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind

from .._version import __version__
from ..fileio import atomic_directory
from ..frontends.common import training_flags
from ..progress import shows
from ..rewriter import amp_rewrite, plan_of
from ..rewriter.gc_scope import young_objects_only
from ..rewriter.overlap import one_graph
from ..frontends.common import as_tuple
from .._torch import tree_leaves
from .onnx_metadata import FX_NODE, FX_NODE_RE, MODULE, NOTE, get_meta, set_meta
from . import dynamic, true_fp16
from .onnx_passes import run_onnx_steps
from .program import exported_program
from .errors import ExportError
from .verify import check_export, input_names
from .weight_view import fold_view_batchnorms, low_weights_view, restore_weight_casts

log = logging.getLogger(__name__)

#: the file's metadata key saying which graph the exporter translated: the planned graph
#: itself (``PLANNED``) or a new capture of it (``CAPTURED``)
CAPTURE = "fxamp.capture"
PLANNED = "planned graph"
CAPTURED = "captured again"


@contextlib.contextmanager
def _eval_mode(gm: torch.nn.Module) -> Iterator[None]:
    """Export for inference: every module in eval mode, flags restored afterwards."""
    with training_flags(gm, False):
        yield


def _fx_names(ep: Any, gm: fx.GraphModule) -> Dict[str, str]:
    """Exported-program node name -> name of the node of ``gm`` it came from.

    torch.export records provenance in ``node.meta["from_node"]`` (a chain of NodeSource);
    the deepest source whose graph is ``gm.graph`` (or whose name is a node of ``gm``) is it.
    """
    names = {n.name for n in gm.graph.nodes}
    gid = id(gm.graph)
    out: Dict[str, str] = {}

    def deepest(source: Any) -> Optional[str]:
        found = None
        if getattr(source, "graph_id", None) == gid and source.name in names:
            found = source.name
        for parent in getattr(source, "from_node", None) or []:
            deeper = deepest(parent)
            if deeper is not None:
                return deeper
        return found

    for node in ep.graph.nodes:
        sources = node.meta.get("from_node") or []
        hit = None
        for source in reversed(sources):
            hit = deepest(source)
            if hit:
                break
        if hit is None and node.op == "call_function" and node.name in names:
            hit = node.name
        if hit is not None and node.op != "placeholder":
            out[node.name] = hit
    return out


def _export_dynamo(gm: fx.GraphModule, inputs: tuple, opset: Optional[int],
                   spec: Optional[Tuple[Any, ...]] = None
                   ) -> Tuple[Any, Dict[str, str], Any, str, List[Tuple[str, str]]]:
    """The dynamo exporter's graph, unoptimised (the ONNX steps, ``.onnx_passes``, run the
    optimizer once fxamp has folded the constants from their FP32 values). The exporter is
    given the graph with its weights cast already (``.weight_view``: half the ops to
    trace on a CNN); the file is what the casting graph exports to. An ATen graph (the
    ``torch.export`` front end's) goes to the exporter as the ``ExportedProgram`` it is
    (``.program``), without a second ``torch.export``; any other graph, or one the
    exporter refuses in that form, is exported (captured) as a module. Inference BatchNorm
    modules reading a convolution alone are folded into it in the view first
    (:func:`.weight_view.fold_view_batchnorms`: the file the ONNX fold would write, for
    less export work). Returns the model, the exporter's node names -> the plan's, the
    exporter's program, ``PLANNED`` or ``CAPTURED``, and the (conv, BatchNorm) node names
    folded in the view. With dynamic axes (``spec``, positional ``dynamic_shapes``) the
    graph is captured with them: the planned program holds the example's sizes."""
    kwargs: Dict[str, Any] = {"dynamo": True, "verbose": False, "optimize": False}
    if opset is not None:
        kwargs["opset_version"] = opset
    if spec is not None:
        kwargs["dynamic_shapes"] = spec
    if not isinstance(gm, fx.GraphModule):
        with contextlib.redirect_stdout(io.StringIO()):
            program = torch.onnx.export(gm, inputs, **kwargs)
        return program.model_proto, {}, program.exported_program, CAPTURED, []
    view, sources = low_weights_view(gm)
    folds = fold_view_batchnorms(view, sources)
    program, mapping = (None, {}) if spec is not None else \
        _export_program(view, inputs, kwargs)
    capture = PLANNED
    if program is None:
        capture = CAPTURED
        with contextlib.redirect_stdout(io.StringIO()):
            program = torch.onnx.export(view, inputs, **kwargs)
        mapping = _fx_names(program.exported_program, view)
    proto = program.model_proto
    restore_weight_casts(proto, sources)
    return proto, mapping, program.exported_program, capture, folds


def _export_program(view: fx.GraphModule, inputs: tuple, kwargs: Dict[str, Any]
                    ) -> Tuple[Any, Dict[str, str]]:
    """``view`` exported from its own ATen graph (:func:`.program.exported_program`): the
    exporter's program and the names of ``view``'s nodes; (None, {}) where the graph does
    not fit or the exporter refuses the program (the caller then captures ``view``)."""
    try:
        built = exported_program(view, inputs)
        if built is None:
            return None, {}
        ep, renamed = built
        with contextlib.redirect_stdout(io.StringIO()):
            program = torch.onnx.export(ep, inputs, input_names=[
                s.arg.name for s in ep.graph_signature.input_specs
                if s.kind == InputKind.USER_INPUT], **kwargs)
    except Exception as err:  # noqa: BLE001 - the capture below is the fallback
        log.info("exporting the rewritten graph as it is failed (%s: %s); capturing it "
                 "with torch.export", type(err).__name__, str(err).splitlines()[0]
                 if str(err) else "")
        return None, {}
    names = _fx_names(program.exported_program, ep.graph_module)
    return program, {k: renamed.get(v, v) for k, v in names.items()}


def _export_torchscript(gm: fx.GraphModule, inputs: tuple, opset: Optional[int],
                        spec: Optional[Tuple[Any, ...]] = None) -> Any:
    """The TorchScript exporter's graph, without its constant folding: that would write
    each weight FP16 before the ONNX steps fold BatchNorm from the FP32 weight (a folded
    weight rounded twice); the ONNX steps fold the constants instead. ``spec``'s dynamic
    axes become the exporter's ``dynamic_axes``."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        kwargs: Dict[str, Any] = {"dynamo": False, "do_constant_folding": False}
        if opset is not None:
            kwargs["opset_version"] = opset
        if spec is not None:
            kwargs.update(_torchscript_axes(gm, inputs, spec))
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "legacy exporter": we know
            torch.onnx.export(gm, inputs, path, **kwargs)
        return onnx.load(path)


def _torchscript_axes(gm: torch.nn.Module, inputs: tuple, spec: Tuple[Any, ...]
                      ) -> Dict[str, Any]:
    """The TorchScript exporter's ``input_names`` and ``dynamic_axes`` for ``spec``."""
    names = [f"input_{i}" for i in range(len(inputs))]
    found = dynamic.forward_names(gm, len(inputs))
    if len(found) == len(inputs):
        names = found
    axes: Dict[str, Dict[int, str]] = {}
    for index, axis in dynamic.requested_axes(spec):
        axes.setdefault(names[index], {})[axis] = f"{names[index]}_dim_{axis}"
    return {"input_names": names, "dynamic_axes": axes}


# -- provenance ----------------------------------------------------------------------
def _fx_node_of(node: Any, mapping: Optional[Dict[str, str]]) -> Optional[str]:
    if mapping is None:
        return None
    text = get_meta(node, "pkg.torch.onnx.fx_node")
    if text:
        match = FX_NODE_RE.match(text)
        if match and match.group(1) in mapping:
            return mapping[match.group(1)]
    candidates = [node.name[len("node_"):] if node.name.startswith("node_") else node.name]
    candidates += list(node.output)
    for cand in candidates:
        if cand in mapping:
            return mapping[cand]
    return None


def _torchscript_fx_node(node: Any, gm: fx.GraphModule, by_module: Dict[str, str]) -> \
        Optional[str]:
    """Best effort for the TorchScript exporter: node names are "/scope/Op_N"."""
    scope = node.name.strip("/").rpartition("/")[0].replace("/", ".")
    return by_module.get(scope)


def _scope_paths(node: Any) -> List[str]:
    """The module paths of the scopes the dynamo exporter recorded for ``node``, outermost
    first, without the root and the op itself. The exporter records each scope by its full
    path (``['', 'bert', 'bert.encoder', ..., 'linear']``); scopes recorded as bare names
    (``['', 'bert', 'encoder']``) are joined into paths."""
    scopes = get_meta(node, "pkg.torch.onnx.name_scopes")
    if not scopes or not scopes.startswith("["):
        return []
    parts = [s.strip(" '\"") for s in scopes.strip("[]").split(",")][:-1]
    paths: List[str] = []
    for part in (p for p in parts if p):
        if paths and not part.startswith(paths[-1] + "."):
            part = f"{paths[-1]}.{part}"  # a bare name: join it to its parent's path
        paths.append(part)
    return paths


def _scoped_fx_node(node: Any, by_module: Dict[str, str]) -> Optional[str]:
    """The plan node of the innermost module scope the exporter recorded for ``node``."""
    for path in reversed(_scope_paths(node)):
        hit = by_module.get(path)
        if hit is not None:
            return hit
    return None


def _annotate(model: Any, gm: fx.GraphModule, mapping: Optional[Dict[str, str]]) -> None:
    plan = plan_of(gm)
    by_module: Dict[str, str] = {}
    for name, p in plan.nodes.items():
        if p.module and p.module not in by_module:
            by_module[p.module] = name
    for node in model.graph.node:
        name = (_fx_node_of(node, mapping) if mapping is not None
                else _torchscript_fx_node(node, gm, by_module))
        if name is None:  # e.g. inside an opaque call (rule "runtime"): its module scope
            name = _scoped_fx_node(node, by_module)
        if name is None:
            continue
        set_meta(node, FX_NODE, name)
        p = plan.nodes.get(name)
        module = p.module if p is not None else ""
        if not module:
            paths = _scope_paths(node)
            module = paths[-1] if paths else ""
        set_meta(node, MODULE, module)


def _note_folds(model: Any, folds: List[Tuple[str, str]]) -> None:
    """Note on each Conv of ``model`` that a BatchNorm was folded into in the exporter's
    view (``folds``: (conv, BatchNorm) plan node names), as the ONNX fold notes its own."""
    by_conv = dict(folds)
    for node in model.graph.node:
        bn = by_conv.get(get_meta(node, FX_NODE) or "") if node.op_type == "Conv" else None
        if bn is not None:
            set_meta(node, NOTE, (get_meta(node, NOTE) or "") + f"BatchNorm {bn} folded into "
                     "this Conv by fxamp. ")


def _eval_reference(reference: Optional[torch.nn.Module]) -> Any:
    """``reference`` called in eval mode without grad (None stays None)."""
    if reference is None:
        return None

    def run(*inputs: Any) -> Any:
        with training_flags(reference, False), torch.no_grad():
            return reference(*inputs)
    return run


def _graph_of(ep: Any) -> Any:
    """What the ONNX steps read of the exporter's program (``restore_tiny_adds``: its
    graph), without the program: it holds the exported view's FP16 weights (a copy of
    every weight the plan casts), which need not live through the steps and the checks.

    Args:
        ep: the exporter's ``ExportedProgram``, or None.

    Returns:
        An object with the program's ``graph``, or None.
    """
    return None if ep is None else types.SimpleNamespace(graph=ep.graph)


def _true_fp16_meta(rows: List[Dict[str, Any]], inputs: tuple) -> Dict[str, str]:
    """The file's metadata of the true-FP16 check on the example input: its result per
    output and the digest of the inputs (what ``precision_report`` reads back instead of
    running the check again), and what was sampled; nothing where it did not run.

    Args:
        rows: ``verify.true_fp16_row`` per output.
        inputs: the example's positional arguments.

    Returns:
        Metadata key -> value.
    """
    if not rows:
        return {}
    leaves = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    meta = {true_fp16.ROWS_KEY: json.dumps(rows), true_fp16.DIGEST_KEY:
            true_fp16.inputs_digest(leaves)}
    sampled = [row["sampled"] for row in rows if "sampled" in row]
    if sampled:
        meta[true_fp16.SAMPLED_KEY] = "; ".join(sampled)
    return meta


@shows(lambda gm, inputs, path, **k: f"ONNX export to {os.path.basename(path)}")
def export_onnx(gm: fx.GraphModule, example_inputs: Any, path: str, *,
                opset: Optional[int] = None, exporter: str = "auto",
                reference: Optional[torch.nn.Module] = None,
                dynamic_shapes: Any = None) -> str:
    """Export a model made by ``fxamp.amp_rewrite`` to ONNX.

    Before the file is written, the exported graph is run with onnxruntime and compared with
    the rewritten model on the example inputs and a second, different input (see
    ``fxamp.export.verify``): a graph that disagrees (a traced value-dependent branch) is
    refused. The casts of the rewritten graph become ONNX Cast nodes and FP16 initializers
    (the weight casts are constant-folded), FP32 islands stay FP32. The export is for
    inference: modules are put in eval mode for it (their flags are restored). The file's
    metadata holds the plan and what the export repaired.

    A model ``amp_rewrite(..., inplace=True)`` rewrote exports the graph it computes with;
    one in block mode (rewritten in place without example inputs) exports a flat rewrite
    of its FP32 form with its config, made on ``example_inputs`` (``overlap.one_graph``); the
    model keeps its rewrite either way.

    With ``dynamic_shapes`` the file's axes it names are dynamic (``fxamp.export.dynamic``):
    a graph traced for the example's sizes (a deployment plan is planned static) is made
    again from its model with its config and those shapes, and the checks run at the
    example's sizes and at other sizes of those axes too.

    Args:
        gm: a GraphModule ``fxamp.amp_rewrite`` made, or a model it rewrote in place.
        example_inputs: the forward's arguments to export with (a tuple, or one tensor).
        path: the ``.onnx`` file to write (atomically; a model over 1.8 GB gets its
            weights in ``path + ".data"``).
        opset: the ONNX opset (default: the exporter's).
        exporter: ``"auto"`` (dynamo, then TorchScript), ``"dynamo"`` or
            ``"torchscript"``.
        reference: the FP32 model the file is checked against (default: ``gm`` with its
            casts made FP32, see ``fxamp.export.reference.fp32_reference``); the check
            never runs an FP16 op in PyTorch.
        dynamic_shapes: the file's dynamic axes, as ``torch.export`` takes them (a dict
            keyed by the forward's parameter names, or a tuple with one entry per input:
            ``{0: Dim.AUTO}``, a list per axis, or None); ``"auto"``: the batch (dim 0) of
            every tensor input and the sequence (dim 1) of integer inputs of two or more
            dimensions; None (default): every axis as the example has it.

    Returns:
        ``path``.

    Raises:
        ExportError: onnx, onnxscript or onnxruntime is missing, an unknown ``exporter``,
            every exporter failed, or the exported graph disagrees with the model.
        DynamicShapesError: an axis of ``dynamic_shapes`` cannot be dynamic (the message
            says why and what to do).
        FxampError: ``gm`` was not made by ``amp_rewrite``.
    """
    try:
        import onnx  # noqa: F401 - (the check that it is installed)
    except ImportError:
        raise ExportError("export_onnx needs onnx, onnxscript and onnxruntime; what to do: "
                          "pip install 'fxamp[onnx]' (or pip install onnx onnxscript "
                          "onnxruntime)") from None
    inputs = as_tuple(example_inputs)
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ExportError(f"exporter must be auto, dynamo or torchscript, got {exporter!r}")
    gm = one_graph(gm, inputs, amp_rewrite)
    spec = dynamic.positional_spec(dynamic_shapes, gm, inputs)
    if spec is not None and not dynamic.requested_axes(spec):
        spec = None  # (every axis static: the example's sizes, as without a spec)
    if spec is not None:
        gm = dynamic.dynamic_graph(gm, inputs, spec)
    plan = plan_of(gm)
    with young_objects_only():  # (full collections scan what the export allocates only)
        return _export_onnx(gm, plan, inputs, path, opset, exporter, reference, spec)


def _export_onnx(gm: fx.GraphModule, plan: Any, inputs: tuple, path: str,
                 opset: Optional[int], exporter: str,
                 reference: Optional[torch.nn.Module],
                 spec: Optional[Tuple[Any, ...]] = None) -> str:
    """:func:`export_onnx`'s work, its arguments checked."""
    import onnx

    used, error, capture = "", "", CAPTURED
    mapping: Optional[Dict[str, str]] = None
    ep = None
    folds: List[Tuple[str, str]] = []
    with _eval_mode(gm):
        if exporter in ("auto", "dynamo"):
            try:
                model, mapping, ep, capture, folds = _export_dynamo(gm, inputs, opset, spec)
                used = "dynamo"
            except Exception as err:  # noqa: BLE001 - any exporter failure: try the next
                error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                if exporter == "dynamo":
                    raise ExportError(f"torch.onnx.export(dynamo=True) failed: {error}; what "
                                      "to do: try exporter='torchscript'") from err
                log.warning("dynamo exporter failed (%s); trying the TorchScript exporter",
                            error)
        if not used:
            try:
                model = _export_torchscript(gm, inputs, opset, spec)
                used = "torchscript"
            except Exception as err:  # noqa: BLE001
                raise ExportError(f"both ONNX exporters failed; dynamo: {error or '-'}; "
                                  f"torchscript: {type(err).__name__}: {err}") from err
    graph = _graph_of(ep)
    ep = None  # (the exporter's program holds the FP16 view's weights: its graph is enough)
    gc.collect()  # (the exporter's objects hold it in reference cycles: freed now, not later)
    steps = run_onnx_steps(model, used, graph)
    model, counts = steps.model, steps.counts
    steps = None
    repaired, eps_fixed = counts["types"], counts["eps"]
    _annotate(model, gm, mapping)
    _note_folds(model, folds)
    axes = dynamic.requested_axes(spec) if spec is not None else []
    names = input_names(model)
    extra: List[Tuple[str, tuple]] = []
    if axes:
        dynamic.check_file_axes(model, names, inputs, axes)
        other = dynamic.other_shape(inputs, axes)
        extra.append((f"the example at other sizes ({dynamic.shape_text(other)})", other))
    # a traced graph (TorchScript) holds the branches the example took: check the file on a
    # second input too; torch.export's graph is checked the same way (cheap insurance)
    rows: List[Dict[str, Any]] = []
    with _eval_mode(gm):
        checked, true_fp16 = check_export(model, gm, inputs, used,
                                          _eval_reference(reference), extra, rows)
    meta = {"fxamp.version": __version__, "fxamp.exporter": used, CAPTURE: capture,
            "fxamp.plan": plan.to_text(),
            "fxamp.folded_weight_casts": str(sum(counts.get(name, 0) for name in (
                "constants", "constants_again", "weight_casts"))),
            "fxamp.restored_eps_adds": str(counts.get("eps_adds", 0)),
            "fxamp.repaired_initializers": str(repaired), "fxamp.eps_fixed": str(eps_fixed),
            "fxamp.checked_inputs": str(checked),
            "fxamp.folded_batchnorms": str(counts["batchnorm"] + len(folds)),
            "fxamp.removed_casts": str(counts["casts"]),
            "fxamp.true_fp16_error": (f"{true_fp16:.3g}" if isinstance(true_fp16, float)
                                      else "-")}
    if axes:
        meta[dynamic.AXES_KEY] = dynamic.axes_text(names, axes)
        meta["fxamp.checked_shapes"] = "; ".join(
            dynamic.shape_text(case) for case in [inputs] + [c for _, c in extra])
    if isinstance(true_fp16, str):  # (not checked, and why: never silently)
        meta["fxamp.true_fp16_skipped"] = true_fp16
    meta.update(_true_fp16_meta(rows, inputs))
    if error:
        meta["fxamp.dynamo_error"] = error
    for key, value in meta.items():
        set_meta(model, key, value)
    onnx.checker.check_model(model)
    large = model.ByteSize() > 1_800_000_000
    with atomic_directory(path) as tmpdir:  # the old file(s) survive any failure
        onnx.save(model, os.path.join(tmpdir, os.path.basename(path)),
                  save_as_external_data=large,
                  location=os.path.basename(path) + ".data" if large else None)
    log.info("exported %s with the %s exporter (%d initializers repaired, %d eps fixed)", path,
             used, repaired, eps_fixed)
    return path
