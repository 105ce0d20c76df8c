"""Model Explorer node data, loaded with Model Explorer's own node-data classes and checked
against the node ids its own adapters (PyTorch ExportedProgram, model-explorer-onnx) give."""
import json
import logging

import pytest
import torch

from fxamp import cli
from fxamp.demo import small_cnn
from fxamp.show import COLOURS

dacite = pytest.importorskip("dacite")
node_data_builder = pytest.importorskip("model_explorer.node_data_builder")


def _load(path):
    """The file as Model Explorer's ModelNodeData (strict: unknown keys are errors)."""
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    config = dacite.Config(strict=True)
    return node_data_builder.ModelNodeData(graphsData={
        graph: dacite.from_dict(node_data_builder.GraphNodeData, data, config=config)
        for graph, data in raw.items()})


@pytest.mark.slow
def test_show_model_explorer_covers_every_node_of_the_exported_program(tmp_path, capsys):
    from model_explorer.pytorch_exported_program_adapter_impl import (
        PytorchExportedProgramAdapterImpl)

    out = tmp_path / "plan.json"
    assert cli.main(["show", "fxamp.demo:small_cnn", "--format", "model-explorer",
                     "-o", str(out)]) == 0
    precision, rules = _load(out), _load(tmp_path / "plan.rule.json")
    model, inputs = small_cnn()
    program = torch.export.export(model, inputs)
    graphs = PytorchExportedProgramAdapterImpl(
        program, {"const_element_count_limit": 16}).convert()["graphs"]
    drawn = {g.id: [n.id for n in g.nodes] for g in graphs}
    assert set(drawn) == set(precision.graphsData) == set(rules.graphsData) == {"graph"}
    results = precision.graphsData["graph"].results
    assert sorted(results) == sorted(drawn["graph"])
    assert sorted(rules.graphsData["graph"].results) == sorted(drawn["graph"])
    # what autocast would do on CUDA: convolutions and linear in fp16, layer_norm in fp32
    assert results["conv2d"].value == 16 and results["conv2d"].bgColor == COLOURS["fp16"]
    assert results["linear"].value == 16
    assert results["layer_norm"].value == 32 and results["layer_norm"].bgColor == COLOURS["fp32"]
    assert results["p_fc_weight"].value == 32  # FP32 master weight
    # every node computing a floating result has a planned precision
    floating = [n.name for n in program.graph.nodes if n.op == "call_function"
                and getattr(n.meta.get("val"), "dtype", None) == torch.float32]
    assert floating and all(results[name].value in (16, 32) for name in floating)


@pytest.mark.slow
def test_export_model_explorer_planned_and_actual_for_every_onnx_node(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    from model_explorer_onnx.main import ONNXAdapter

    onnx_path, data = tmp_path / "m.onnx", tmp_path / "me.json"
    assert cli.main(["export", "fxamp.demo:small_cnn", "-o", str(onnx_path),
                     "--backend", "onnxruntime", "--model-explorer", str(data)]) == 0
    planned, actual = _load(data), _load(tmp_path / "me.actual.json")
    logging.getLogger("model_explorer_onnx").setLevel(logging.ERROR)
    graphs = ONNXAdapter().convert(str(onnx_path), {})["graphs"]
    main = graphs[0]
    assert set(planned.graphsData) == set(actual.graphsData) == {main.id}
    ids = sorted(n.id for n in main.nodes)
    assert sorted(planned.graphsData[main.id].results) == ids
    assert sorted(actual.graphsData[main.id].results) == ids
    convs = [n for n in main.nodes if n.label == "Conv"]
    assert convs and all(planned.graphsData[main.id].results[n.id].value == 16 for n in convs)
    # rule and reason are in the ONNX nodes' metadata, shown by the adapter
    attrs = {a.key: a.value for n in convs for a in n.attrs}
    assert attrs.get("[metadata] fxamp.rule") == "autocast"
    assert "[metadata] fxamp.reason" in attrs


def test_model_explorer_needs_the_export_front_end(tmp_path, capsys):
    assert cli.main(["show", "fxamp.demo:small_cnn", "--format", "model-explorer",
                     "--frontend", "fx", "-o", str(tmp_path / "x.json")]) == 2
    assert "export front end" in capsys.readouterr().err


def test_a_plan_of_another_graph_is_refused_not_drawn_grey():
    import fxamp
    from fxamp.errors import FxampError
    from fxamp.model_explorer import program_node_data

    model, inputs = small_cnn()
    fx_plan = fxamp.plan_of(fxamp.amp_rewrite(model, inputs,
                                              fxamp.RewriteConfig.make(frontend="fx")))
    with pytest.raises(FxampError, match="no line in the plan"):
        program_node_data(torch.export.export(model, inputs), fx_plan)
