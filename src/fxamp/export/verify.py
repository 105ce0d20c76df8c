"""Check an exported ONNX graph against PyTorch: the rewritten model and the ONNX file (run
with onnxruntime) must agree on the example inputs and on a second, different input (the
example's floating tensors negated: a branch on a sign, a sum or a max goes the other way),
and, when the file has a dynamic batch axis, on a batch of twice the size. onnxruntime runs it
without graph optimizations: their fusions and layout changes check nothing more of the file
and cost more than the runs on a CNN, and their constant folding would store an FP32 copy of
each FP16 weight that its CPU kernels read through a Cast.

A tracing exporter (TorchScript) records the branch the example input took; torch.export
refuses value-dependent branches, but the eager front end's results (whose own forward is
Python) can only be traced. A file that disagrees is refused with an ``ExportError`` naming
the input and the output that differ, never written. When the rewritten model itself
overflows there (its low-precision output is inf/NaN where FP32 is finite), the cause is the
plan's numbers, not the trace: a ``PlanOverflowError`` names the node, the value it reaches
and the fixes. The file is also run in true FP16 (``onnx.reference``, every op in its
declared type) on the example input; inf/NaN there where the model is finite is refused the
same way.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from .._torch import tree_leaves, tree_map

import torch.fx as fx

from .overflow import (PlanOverflowError, find_overflow, first_divergent_node,
                       first_nonfinite_node, unrunnable)
from .reference import (TRUE_FP16_RTOL, error_parts, fp32_reference, relative_of,
                        tensor_outputs)
from .true_fp16 import Sampled, run_bounded, sampled_like
from .dynamic import STATIC_ADVICE
from .errors import DynamicShapesError, ExportError
from .ort_layers import lean_options

log = logging.getLogger(__name__)

#: outputs agree when |onnx - torch| <= RTOL * |torch| + ATOL * max(1, max |torch|): the two
#: compute in the same precisions but round differently (fp16 sums, fused kernels)
RTOL, ATOL = 0.02, 0.02


def second_input(value: Any) -> Any:
    """A different input of the same structure and shapes: floating tensors negated (plus 1
    where that changes nothing), other values as they are."""
    def other(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            neg = -t
            return neg + 1 if torch.equal(neg, t) else neg
        return t
    return tree_map(other, value)


def _double_batch(first: Any, second: Any) -> Optional[Any]:
    """The two inputs stacked along dim 0 (None when the tensors have no common batch)."""
    sizes = {t.shape[0] for t in tree_leaves(first) if isinstance(t, torch.Tensor) and t.dim()}
    if len(sizes) != 1:
        return None
    return tree_map(lambda a, b: torch.cat([a, b]) if isinstance(a, torch.Tensor) and a.dim()
                    else a, first, second)


def _graph_inputs(proto: Any) -> List[Any]:
    initializers = {i.name for i in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in initializers]


def _dynamic_batch(proto: Any) -> bool:
    inputs = _graph_inputs(proto)
    dims = [i.type.tensor_type.shape.dim for i in inputs]
    return bool(dims) and all(len(d) and not d[0].HasField("dim_value") for d in dims)


def _compare(got: List[Any], want: List[torch.Tensor]) -> Optional[Tuple[int, str]]:
    """(output index, what differs) for the first output that disagrees, else None."""
    if len(got) != len(want):
        return -1, f"the ONNX graph has {len(got)} outputs, the model returns {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g_t = torch.as_tensor(g).float()
        w_t = w.detach().float().cpu()
        if tuple(g_t.shape) != tuple(w_t.shape):
            return i, f"shape {tuple(g_t.shape)} instead of {tuple(w_t.shape)}"
        scale = max(1.0, float(w_t.nan_to_num(0, 0, 0).abs().max()) if w_t.numel() else 1.0)
        if not torch.allclose(g_t, w_t, rtol=RTOL, atol=ATOL * scale, equal_nan=True):
            diff = float((g_t - w_t).nan_to_num(0, 0, 0).abs().max())
            return i, f"values differ by up to {diff:.4g} (max |output| {scale:.4g})"
    return None


class ExporterNumbersError(ExportError):
    """The ONNX exporter or its optimizer changed the numbers: the rewritten model agrees with
    FP32, the file does not (never a tracing problem of torch.export's graph)."""


def _run_rewritten(model: torch.nn.Module, case: Any) -> Optional[List[torch.Tensor]]:
    """The rewritten model's own outputs in PyTorch (its FP16 ops and all), or None where
    PyTorch cannot run them here (no FP16 CPU kernel)."""
    try:
        with torch.no_grad():
            return tensor_outputs(model(*case))
    except Exception as err:  # noqa: BLE001 - e.g. oneDNN has no FP16 LSTM on this CPU
        log.info("the rewritten model does not run in PyTorch here (%s: %s): checked "
                 "against FP32 only", type(err).__name__, str(err).splitlines()[:1])
        return None


def _mismatch(model: torch.nn.Module, case: Any, what: str, got: List[Any],
              problem: Tuple[int, str], exporter: str,
              want: Optional[List[torch.Tensor]] = None) -> ExportError:
    """The error for a file that disagrees with FP32 (``want``) on ``case``: the plan's
    numbers (the rewritten model overflows, agrees with the file, or is itself off FP32
    beyond the tolerance: measured before blaming anything else), the exporter's optimizer
    (torch.export's graph holds no branch, so the exporter changed the numbers), or a
    traced branch."""
    index, detail = problem
    which = f"output {index}" if index >= 0 else "the outputs"
    overflow = find_overflow(model, case) if isinstance(model, fx.GraphModule) else None
    if overflow is not None:  # the plan's numbers, not the export, differ
        return overflow.error(what)
    own = _run_rewritten(model, case)
    if own is not None and _compare(got, own) is None:
        return PlanOverflowError(
            f"the plan's precision changes the result on {what}: the rewritten model and its "
            f"ONNX file agree, and both differ from FP32: {which}: {detail}. what to do: give "
            "calibration_data like this input, keep the sensitive nodes in FP32 with a policy "
            "override ('fp32:NODE'), or rewrite with target='tensorrt'")
    off = _compare(own, want) if own is not None and want is not None else None
    if off is not None:  # (the rewritten model is off FP32 too: the plan, not the exporter)
        index2, detail2 = off
        own_which = f"output {index2}" if index2 >= 0 else "the outputs"
        return PlanOverflowError(
            f"the plan's precision changes the result on {what} beyond the check's "
            f"tolerance (rtol {RTOL:g}, atol {ATOL:g} of the output's scale): the rewritten "
            f"model itself differs from FP32 ({own_which}: {detail2}), and its ONNX file by "
            f"as much again ({which}: {detail}), each rounding its FP16 ops in its own "
            "order. what to do: keep the "
            "sensitive nodes in FP32 with a policy override ('fp32:NODE'; fxamp.search finds "
            "them within a tolerance), give calibration_data like this input, or, for "
            "random weights, check with trained ones")
    if exporter != "torchscript":
        return ExporterNumbersError(
            f"the {exporter} ONNX exporter changed the numbers on {what}: {which}: {detail}, "
            "while the rewritten model agrees with FP32 (torch.export's graph holds no "
            "branch on tensor values, so this is the exporter's translation or its optimizer "
            "(onnxscript), not tracing). what to do: export with exporter='torchscript', or "
            "report it to torch.onnx with the model")
    return ExportError(
        f"the {exporter} exporter's graph does not compute what the model computes "
        f"on {what}: {which}: {detail}. A tracing exporter records only the branch "
        "the example input took (Python control flow on tensor values, e.g. "
        "'if x.sum() > 0', in the model's forward); the file is not written. what to "
        "do: write the branch as a tensor op (torch.where), or export the model's "
        "traceable parts (its rewritten submodules) on their own")


def check_export(proto: Any, model: torch.nn.Module, inputs: tuple, exporter: str,
                 reference: Optional[Callable[..., Any]] = None,
                 extra: Sequence[Tuple[str, tuple]] = (),
                 rows: Optional[List[Dict[str, Any]]] = None
                 ) -> Tuple[int, Union[float, str, None]]:
    """Run ``proto`` with onnxruntime and the FP32 reference (``reference``, default the
    rewritten ``model`` with its casts made FP32: :func:`fp32_reference`) on the example
    inputs, a second input, (dynamic batch only) a double batch and the ``extra`` cases
    ((what, inputs): the example at other sizes of a file's dynamic axes, which must run);
    raise ExportError when they disagree or the file cannot be checked; then the true-FP16
    check (:func:`check_true_fp16`) on the example and the ``extra`` cases. Returns (the
    number of inputs checked, the largest true-FP16 relative error, or why it was not
    measured). ``rows``: where given, the true-FP16 result of each output on the example
    input is appended (:func:`true_fp16_row`). onnxruntime's session and the serialized
    file are dropped before the true-FP16 run (one copy of the weights less)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ExportError("checking the exported graph needs onnxruntime; what to do: pip "
                          "install 'fxamp[onnx]'") from None
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta"
           for t in tree_leaves(inputs)):
        raise ExportError("the example inputs are on device 'meta': the exported graph "
                          "cannot be checked against PyTorch; what to do: export with real "
                          "example inputs")
    try:
        data = proto.SerializeToString()  # (what onnxruntime loads; its size is the check)
    except Exception:  # noqa: BLE001 - protobuf refuses a message past 2 GB (EncodeError
        data = None  # or ValueError, by implementation)
    if data is None or len(data) > 1_800_000_000:
        raise ExportError(f"the {exporter} exporter's graph is too large (> 1.8 GB) to check "
                          "against PyTorch in memory; what to do: export the model's parts")
    ref = reference if reference is not None else fp32_reference(model)
    try:
        session = _session(ort, data)
        data = None  # (the session holds its own copy)
    except Exception as err:  # noqa: BLE001 - e.g. no CPU kernel for a bf16 op
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if exporter != "torchscript":  # torch.export's graph is sound without the check
            log.warning("the exported graph was not run against PyTorch: onnxruntime on CPU "
                        "cannot load it (%s)", why)
            data = None
            return 0, check_true_fp16(proto, ref, inputs, input_names(proto), model,
                                      rows=rows)
        raise ExportError(
            f"the {exporter} exporter traced the model, and the traced graph cannot be "
            f"checked against PyTorch: onnxruntime on CPU cannot load it ({why}); an unchecked "
            "trace may hold the wrong branch of a value-dependent 'if', so it is not written. "
            "what to do: make the model exportable by torch.export (frontend='export'), or "
            "export with dtype fp16, which onnxruntime runs on CPU") from None
    names = [i.name for i in session.get_inputs()]
    second = second_input(inputs)
    cases: List[Tuple[str, Any]] = [("the example input", inputs),
                                    ("a second input (the example's values negated)", second)]
    cases += list(extra)  # (their axes were asked for: they must run, before the rest)
    if _dynamic_batch(proto):
        double = _double_batch(inputs, second)
        if double is not None:
            cases.append(("a batch of twice the example's size", double))
    strict = {id(case) for what, case in cases[2:]} if extra else set()
    example: Optional[List[Any]] = None  # (the reference's outputs on the example input)
    for done, (what, case) in enumerate(cases):
        leaves = [t for t in tree_leaves(case) if isinstance(t, torch.Tensor)]
        if len(leaves) != len(names):
            raise ExportError(
                f"the {exporter} exporter's graph takes {len(names)} inputs where the model "
                f"takes {len(leaves)} tensors: it cannot be checked against PyTorch, so it is "
                "not written; what to do: pass the model's inputs as plain tensors")
        try:
            with torch.no_grad():
                want = tensor_outputs(ref(*case))
        except Exception as err:  # noqa: BLE001 - at other sizes: the model's code, named
            if id(case) not in strict:
                raise
            raise _other_sizes_error(what, "the model", err) from None
        example = want if example is None else example
        feed = {n: t.detach().cpu().numpy() for n, t in zip(names, leaves)}
        try:
            got = session.run(None, feed)
        except Exception as err:  # noqa: BLE001 - onnxruntime's own errors
            if id(case) in strict:
                raise _other_sizes_error(what, "the exported file (onnxruntime)", err) \
                    from None
            if exporter != "torchscript" and what != "the example input":
                log.warning("the exported graph was checked on the example input only: "
                            "onnxruntime fails on %s (%s)", what, type(err).__name__)
                session = data = None
                return done, check_true_fp16(proto, ref, inputs, names, model, example,
                                             rows=rows)
            raise ExportError(f"the {exporter} exporter's graph fails on {what} in "
                              f"onnxruntime ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); what to do: "
                              "export with example inputs of the shapes it will get") from None
        problem = _compare(got, want)
        if problem is not None:
            raise _mismatch(model, case, what, got, problem, exporter, want)
    session = data = None  # (their memory, before the true-FP16 run's)
    error = check_true_fp16(proto, ref, inputs, names, model, example, rows=rows)
    for what, case in extra:  # (the same check at the other sizes of the dynamic axes)
        if isinstance(error, str):
            break  # (the reference evaluator cannot run this file: said once)
        other = check_true_fp16(proto, ref, case, names, model, what=what)
        error = other if isinstance(other, str) else max(error, other)
    log.info("checked the exported graph against FP32 on %d inputs", len(cases))
    return len(cases), error


def _session(ort: Any, data: bytes) -> Any:
    """An onnxruntime CPU session of the serialized file as written: no fusions or layout
    changes, and no constant folding (which would store an FP32 copy of every FP16 weight
    that a Cast onnxruntime inserts before a kernel it lacks in FP16 reads: twice the
    weights' memory; each run casts them instead, to the same values). Without its memory
    arena (:func:`.ort_layers.lean_options`): the arena keeps the peak of every run.

    Args:
        ort: the onnxruntime module.
        data: the file's bytes.

    Returns:
        The session.
    """
    options = lean_options(ort)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _other_sizes_error(what: str, who: str, err: Exception) -> DynamicShapesError:
    """The error for a file with dynamic axes that ``who`` cannot run at other sizes."""
    return DynamicShapesError(
        f"{who} fails on {what} ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}): the model's code needs the "
        "example's size on an axis dynamic_shapes asks to be dynamic (a reshape to a fixed "
        "size, a size checked against a constant), so the file is not written. "
        f"{STATIC_ADVICE}")


def input_names(proto: Any) -> List[str]:
    """The names of ``proto``'s graph inputs that are no initializers, in order."""
    return [i.name for i in _graph_inputs(proto)]



def check_true_fp16(proto: Any, reference: Callable[..., Any], inputs: tuple,
                    names: List[str], model: Optional[torch.nn.Module] = None,
                    want: Optional[List[Any]] = None,
                    what: str = "the example input",
                    rows: Optional[List[Dict[str, Any]]] = None) -> Union[float, str]:
    """Run ``proto`` on ``inputs`` (``what``: the example input by default) with every op
    in its declared type (``onnx.reference``) and compare it with the FP32 ``reference``:
    an output that differs by more than :data:`TRUE_FP16_RTOL` of its scale (or is inf/NaN
    where FP32 is finite) is a PlanOverflowError naming the first ONNX node that goes
    wrong, its fx node and the fix (the rewritten ``model``'s own overflow, where PyTorch
    runs it, names its node and range first). ``want``: the reference's outputs on
    ``inputs`` where the caller has them (else it runs). The run holds only the values
    still to be read, and an output of more than ``true_fp16.SAMPLE_LIMIT`` values that
    a constant projection makes (a language model's logits) is compared on a sample of its
    columns (:func:`.true_fp16.run_bounded`). ``rows``: where given, one dict per output
    is appended (:func:`true_fp16_row`: what the precision report reads back from the
    file instead of running the check again). Returns the largest relative error, or why
    the file was not checked (the reference evaluator cannot run it: logged as a
    warning)."""
    leaves = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    feed = {n: t.detach().cpu().numpy() for n, t in zip(names, leaves)}
    try:
        run = run_bounded(proto, feed)
    except Exception as err:  # noqa: BLE001 - an op the reference evaluator lacks
        reason = unrunnable(err)
        log.warning("the exported file was not checked in true FP16: %s; its metadata "
                    "says so (fxamp.true_fp16_skipped)", reason)
        return reason
    if want is None:
        with torch.no_grad():
            want = tensor_outputs(reference(*inputs))
    outputs = [o.name for o in proto.graph.output]
    errors = []
    for index, (g, w) in enumerate(zip(run.outputs, want)):
        sampled = run.sampled.get(index)
        diff, scale = error_parts(g, sampled_like(w, sampled))
        errors.append(relative_of(diff, scale))
        if rows is not None:
            rows.append(true_fp16_row(outputs[index] if index < len(outputs) else str(index),
                                      diff, scale, sampled))
    worst = max(errors, default=0.0)
    if worst == worst and worst <= TRUE_FP16_RTOL:
        return worst
    overflow = find_overflow(model, inputs) if isinstance(model, fx.GraphModule) else None
    if overflow is not None:
        raise overflow.error(what)
    nonfinite = worst == float("inf")
    node = first_nonfinite_node(proto, feed) if nonfinite else \
        first_divergent_node(proto, feed, TRUE_FP16_RTOL)
    label = node.name if node is not None else "?"
    fx_name = next((p.value for p in node.metadata_props if p.key == "fxamp.fx_node"),
                   None) if node is not None else None
    where = f"ONNX node {label!r} ({node.op_type}" if node is not None else "a node ("
    where += f", fx node {fx_name!r})" if fx_name else ")"
    case = what
    what = ("gives inf/NaN while its inputs are finite" if nonfinite else
            f"is the first to differ from its FP32 value by more than {TRUE_FP16_RTOL:g} of "
            f"its scale (the outputs differ by up to {worst:.3g} of theirs, tolerance "
            f"{TRUE_FP16_RTOL:g})")
    raise PlanOverflowError(
        f"the exported file is wrong in true FP16 on {case}: {where} {what} "
        "(onnx.reference computes every op in its declared type; onnxruntime's CPU provider "
        "runs FP16 nodes in FP32 and hides it). what to do: keep it in FP32 with the policy "
        f"override 'fp32:{fx_name or label}', give calibration_data that reaches these "
        "values, or rewrite with target='tensorrt'")


def true_fp16_row(output: str, diff: float, scale: float,
                  sampled: Optional[Sampled]) -> Dict[str, Any]:
    """One output's true-FP16 result, as the export stores it (``fxamp.true_fp16_rows``).

    Args:
        output: the graph output's name.
        diff: the largest |true FP16 - FP32| (inf: inf/NaN where FP32 is finite).
        scale: the output's largest |FP32| value.
        sampled: how the output was sampled (None: every value compared).

    Returns:
        ``{"output", "max_abs", "ref_max"}`` and, for a sample, ``"values"`` (how many
        were compared), ``"of"`` (the whole output's number) and ``"sampled"`` (what).
    """
    row: Dict[str, Any] = {"output": output, "max_abs": diff, "ref_max": scale}
    if sampled is not None:
        row.update(values=sampled.evaluated, of=sampled.total, sampled=sampled.text())
    return row
