"""A tied weight is stored once in the FP16 file: GPT-2's token embedding is the Gather
table and, transposed, the lm_head MatMul's weight. The constant fold kept the transposed
copy as a second initializer (the file 1.4x its size at real size); now a Transpose read by
a computing node stays a node where its input is read as it is too, with the same numbers
and no more Casts."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import fxamp

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from fxamp.export import constants, export_onnx  # noqa: E402

pytestmark = pytest.mark.slow
VOCAB, HIDDEN = 1000, 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=2,
                                  n_positions=64, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def _tables(model) -> int:
    return sum(1 for i in model.graph.initializer if int(np.prod(i.dims)) == VOCAB * HIDDEN)


def _run(path: str, ids: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]


def test_a_tied_embedding_is_stored_once_with_the_same_numbers(tmp_path, monkeypatch):
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 16))
    gm = fxamp.amp_rewrite(model, (ids,), "compute=fp16,target=tensorrt")
    path = export_onnx(gm, (ids,), str(tmp_path / "tied.onnx"))
    with monkeypatch.context() as patch:  # the previous behaviour: every Transpose folded
        patch.setattr(constants, "_shared_transposes", lambda consts, folded: set())
        before = export_onnx(gm, (ids,), str(tmp_path / "before.onnx"))
    now, old = onnx.load(path), onnx.load(before)
    assert _tables(old) == 2 and _tables(now) == 1
    once = os.path.getsize(before) - VOCAB * HIDDEN * 2  # (one FP16 table fewer)
    assert os.path.getsize(path) <= 1.05 * once, (os.path.getsize(path), once)
    casts = [sum(n.op_type == "Cast" for n in m.graph.node) for m in (now, old)]
    assert casts[0] <= casts[1]
    table = next(i.name for i in now.graph.initializer
                 if int(np.prod(i.dims)) == VOCAB * HIDDEN)
    readers = sorted(n.op_type for n in now.graph.node if table in n.input)
    assert readers == ["Gather", "Transpose"]
    np.testing.assert_array_equal(_run(path, ids), _run(before, ids))


def test_an_untied_weight_is_still_folded_transposed():
    """Only a weight read as it is elsewhere keeps its Transpose: a Linear's weight alone
    is folded transposed, as before (no Transpose reads an initializer)."""
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.arange(12, dtype=np.float32))
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [w])
    model = helper.make_model(graph)
    assert constants.fold_constants(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    shared = helper.make_model(helper.make_graph(
        nodes + [helper.make_node("Gather", ["w", "i"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])], [w]))
    assert constants.fold_constants(shared) == 0
    assert [n.op_type for n in shared.graph.node] == ["Transpose", "MatMul", "Gather"]
    assert [i.name for i in shared.graph.initializer] == ["w"]
