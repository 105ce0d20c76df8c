"""fxamp's constant fold (``fxamp/export/constants.py``) folds a GatherElements of constant
inputs with ``reference_ops.gather_elements`` (the spec's gather, no arithmetic).

BERT gathers its ``token_type_ids`` buffer (1, 512) at its constant position ids (1, 128),
axis 1. fxamp's fold did not take GatherElements, so the node reached onnxscript's optimizer,
whose constant folding evaluates it with ``onnx.reference``; that one (onnx 1.23) gathers
with ``np.choose``, at most 64 choices, and failed: every BERT export logged "Evaluation
failed: cannot reshape array of size 1 into shape (1,128)" and the file kept the constant
GatherElements. Folded before the optimizer runs, the warning is gone, the file holds an
initializer instead, and its numbers are the ones the unfolded file computed, bit for bit.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fxamp  # noqa: E402
from fxamp.export import constants, export_onnx  # noqa: E402
from fxamp.export.reference import relative_error  # noqa: E402


def _run(model: Any, feed: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """The model's outputs in onnxruntime (CPU).

    Args:
        model: a ``ModelProto`` or the path of an ONNX file.
        feed: its inputs by name.

    Returns:
        Its outputs, in order.
    """
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _constant_gathers(model: Any) -> List[str]:
    """The GatherElements nodes of ``model`` whose inputs are all initializers or Constant
    nodes' outputs (those a constant fold should have folded).

    Args:
        model: a ``ModelProto``.

    Returns:
        Their names.
    """
    constant = {i.name for i in model.graph.initializer} | {
        o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in model.graph.node if n.op_type == "GatherElements"
            and all(i in constant for i in n.input if i)]


# -- the fold on small constant graphs, against onnxruntime's GatherElements ------------------

def _gather_graph(data: np.ndarray, indices: np.ndarray, axis: int,
                  cast_to: int = 0) -> Any:
    """``y = GatherElements(data, indices) + x``: data and indices initializers (``data``
    read through a Cast to ``cast_to`` when given, as the exporter writes a weight), ``x``
    the graph's input (so that the gather is not the graph's output, which is never folded).

    Args:
        data: the gathered initializer.
        indices: the indices initializer.
        axis: the gathered axis.
        cast_to: an ONNX element type to cast ``data`` to first (0: none).

    Returns:
        The model (opset 18).
    """
    nodes = []
    table = "data"
    if cast_to:
        nodes.append(helper.make_node("Cast", ["data"], ["data_cast"], to=cast_to))
        table = "data_cast"
    nodes += [helper.make_node("GatherElements", [table, "indices"], ["gathered"], axis=axis,
                               name="the_gather"),
              helper.make_node("Add", ["gathered", "x"], ["y"])]
    elem = cast_to or helper.np_dtype_to_tensor_dtype(data.dtype)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", elem, indices.shape)],
        [helper.make_tensor_value_info("y", elem, indices.shape)],
        [numpy_helper.from_array(data, "data"), numpy_helper.from_array(indices, "indices")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=9)


def _x(model: Any) -> Dict[str, np.ndarray]:
    """A nonzero input ``x`` for :func:`_gather_graph`'s model.

    Args:
        model: the model.

    Returns:
        The feed ``{"x": ...}``.
    """
    value = model.graph.input[0]
    dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
    shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
    return {"x": (np.arange(np.prod(shape)).reshape(shape) % 7 + 1).astype(dtype)}


_CASES: Dict[str, Tuple[np.ndarray, np.ndarray, int, int]] = {
    # BERT's: a (1, 512) int64 table gathered at (1, 128) positions on axis 1 (distinct
    # values, so that a wrong gather shows)
    "bert_token_types": ((np.arange(512, dtype=np.int64) * 3)[None],
                         np.arange(128, dtype=np.int64)[None], 1, 0),
    # axis 0, over 64 rows, indices narrower than the data on axis 1, negative indices
    "axis0_negative": (np.arange(100 * 6, dtype=np.int64).reshape(100, 6),
                       np.array([[-1, 0, 99, -100], [5, 70, -3, 64]], dtype=np.int64), 0, 0),
    # an FP32 weight behind the exporter's Cast to FP16: gathered wide, rounded once (the
    # same values as cast-then-gather: a gather moves values, it rounds nothing)
    "fp16_weight": (np.random.default_rng(0).standard_normal((3, 80)).astype(np.float32),
                    np.random.default_rng(1).integers(-80, 80, (3, 40)).astype(np.int32),
                    -1, TensorProto.FLOAT16),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_the_fold_of_a_constant_gather_elements_is_onnxruntimes_gather(case):
    data, indices, axis, cast_to = _CASES[case]
    model = _gather_graph(data, indices, axis, cast_to)
    feed = _x(model)
    want = _run(model, feed)[0]
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert constants.fold_constants(folded) == 1
    assert [n.op_type for n in folded.graph.node] == ["Add"]
    onnx.checker.check_model(folded)
    (init,) = [i for i in folded.graph.initializer if i.name == "gathered"]
    gathered = numpy_helper.to_array(init)
    assert init.data_type == (cast_to or helper.np_dtype_to_tensor_dtype(data.dtype))
    expected = want - feed["x"] if not cast_to else None
    if expected is not None:  # (integers: the gather itself, exactly)
        assert np.array_equal(gathered, expected)
    got = _run(folded, feed)[0]
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_constant_gather_elements_out_of_range_is_not_folded():
    """An index past the axis: not folded (onnxruntime says what is wrong when it runs),
    where onnx.reference's gather would wrap it around."""
    model = _gather_graph(np.arange(10, dtype=np.int64)[None], np.array([[3, 10]]), 1)
    assert constants.fold_constants(model) == 0
    assert [n.op_type for n in model.graph.node] == ["GatherElements", "Add"]


# -- tiny BERT's export -----------------------------------------------------------------------

def _tiny_bert(cls_name: str, shape: Tuple[int, int]) -> Tuple[torch.nn.Module, tuple]:
    """The tiny BERT of the report (``BertConfig(vocab_size=100, hidden_size=32, 2 layers, 2
    heads, intermediate_size=64)``), in eval mode, with random ids.

    Args:
        cls_name: the transformers class (``BertModel``, ``BertForSequenceClassification``).
        shape: the ids' shape.

    Returns:
        (model, (ids,)).
    """
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64)
    return getattr(transformers, cls_name)(cfg).eval(), (torch.randint(0, 100, shape),)


def _export(model: torch.nn.Module, x: tuple, path: str) -> str:
    """The report's export: ``amp_rewrite(model, x, "compute=fp16,target=tensorrt")``, then
    ``export_onnx``.

    Args:
        model: the FP32 model.
        x: its inputs.
        path: the file to write.

    Returns:
        ``path``.
    """
    gm = fxamp.amp_rewrite(model, x, "compute=fp16,target=tensorrt")
    return export_onnx(gm, x, path)


def _outputs(model: torch.nn.Module, x: tuple) -> List[np.ndarray]:
    """The FP32 model's tensor outputs, in the file's order.

    Args:
        model: the FP32 model.
        x: its inputs.

    Returns:
        Its tensor outputs as numpy arrays.
    """
    with torch.no_grad():
        out = model(*x)
    values = out.values() if isinstance(out, dict) else out
    return [t.numpy() for t in values if isinstance(t, torch.Tensor)]


@pytest.mark.slow
@pytest.mark.parametrize("cls_name, shape", [("BertModel", (1, 128)),
                                             ("BertForSequenceClassification", (2, 16))])
def test_berts_constant_gather_is_folded_without_a_warning(tmp_path, caplog, monkeypatch,
                                                           cls_name, shape):
    """No warning from onnxscript or fxamp during the export (torch's own exporter logs
    notes of its own on some versions), no constant GatherElements in the
    file, and the file computes what the file without this fold computes, bit for bit (the
    fold disabled: GatherElements taken out of the ops it folds, as before)."""
    model, x = _tiny_bert(cls_name, shape)
    feed = {"input_ids": x[0].numpy()}
    with caplog.at_level(logging.WARNING):
        path = _export(model, x, str(tmp_path / "bert.onnx"))
    warnings = [f"{r.name}: {r.getMessage()}" for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith(("onnxscript", "fxamp"))]
    assert warnings == []
    proto = onnx.load(path)
    assert not any(n.op_type == "GatherElements" for n in proto.graph.node)
    assert _constant_gathers(proto) == []
    got = _run(path, feed)
    want32 = _outputs(model, x)
    assert len(got) == len(want32) == len(proto.graph.output)
    errors = [relative_error(g, w) for g, w in zip(got, want32)]
    assert max(errors) < 1e-2, errors  # (FP16 rounding's size, as the export tests')

    # the same export without the GatherElements fold: the onnxscript warning (this test
    # sees it: it can fail) and the constant node in the file; the same outputs
    caplog.clear()
    monkeypatch.setattr(constants, "_FOLDABLE", constants._FOLDABLE - {"GatherElements"})
    with caplog.at_level(logging.WARNING):
        before = _export(model, x, str(tmp_path / "before.onnx"))
    if "cannot reshape array of size 1" in caplog.text:  # (else a later onnx folds it:
        assert len(_constant_gathers(onnx.load(before))) == 1  # the CI installs the newest)
    for new, old in zip(got, _run(before, feed)):
        assert new.dtype == old.dtype and np.array_equal(new, old)
