"""The TensorRT inspector parser on real engine JSON published by NVIDIA (tests/data/trt)."""
import os
import re
import warnings

import pytest

from fxamp.export.engine_report import precision_report
from fxamp.export.trt_layers import (EngineInfoError, by_onnx_node, fused_names,
                                     parse_engine_info, precision_boundaries, trt_dtype)

DATA = os.path.join(os.path.dirname(__file__), "data", "trt")
RESNET = os.path.join(DATA, "resnet.onnx.engine.graph.json")
QAT = [os.path.join(DATA, f) for f in ("mobilenet.qat.onnx.engine.graph.json",
                                         "mobilenet_v2_residuals.qat.onnx.engine.graph.json")]


def _resnet18_onnx(tmp_path):
    """torchvision ResNet-18 exported by torch's TorchScript exporter, its nodes named the way
    the exporter named them when NVIDIA built the published engine ("Conv_0", "Relu_1", ...:
    op type and index, Identity nodes not counted)."""
    import onnx
    import torch
    import torchvision

    path = str(tmp_path / "resnet18.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torchvision.models.resnet18().eval(), (torch.randn(1, 3, 224, 224),),
                          path, dynamo=False, opset_version=13)
    model = onnx.load(path)
    compute = [n for n in model.graph.node if n.op_type != "Identity"]
    for i, node in enumerate(compute):
        node.name = f"{node.op_type}_{i}"
    onnx.save(model, path)
    return path, [n.name for n in compute]


@pytest.mark.parametrize("path", [RESNET] + QAT, ids=os.path.basename)
def test_every_layer_and_tensor_precision_is_read(path):
    layers = parse_engine_info(path)
    assert len(layers) >= 30
    for layer in layers:
        assert layer.inputs and layer.outputs, layer.name
        assert all(d in ("fp32", "fp16", "int8") for _, d in layer.inputs + layer.outputs), \
            (layer.name, layer.inputs, layer.outputs)
        assert layer.precision is not None


def test_resnet_fp16_engine_precisions_and_weights():
    layers = parse_engine_info(RESNET)
    compute = [layer for layer in layers if not layer.is_reformat]
    convs = [layer for layer in compute if layer.layer_type == "CaskConvolution"]
    assert len(convs) == 21  # 20 convolutions + the Gemm TensorRT runs as a 1x1 convolution
    assert {layer.precision for layer in compute} == {"fp16"}
    assert {layer.weights for layer in convs} == {"fp16"}  # "Weights": {"Type": "Half"}


def test_fused_names_split_into_onnx_nodes():
    assert fused_names("Conv_5 + Add_6 + Relu_7") == ["Conv_5", "Add_6", "Relu_7"]
    assert fused_names("features.0.0.weight + QuantizeLinear_8 + Conv_12 + PWN(Clip_16)") == [
        "features.0.0.weight", "QuantizeLinear_8", "Conv_12", "Clip_16"]
    assert fused_names("Reformatting CopyNode for Input Tensor 0 to Conv_5 + Add_6 + Relu_7") \
        == []


@pytest.mark.slow
def test_resnet_layers_map_onto_the_real_resnet18_onnx_nodes(tmp_path):
    _, names = _resnet18_onnx(tmp_path)
    layers = parse_engine_info(RESNET, names)
    covered = by_onnx_node(layers)
    # every node of the real ONNX graph is in exactly one engine layer, but Flatten_47, which
    # TensorRT folded into the reshape after the Gemm
    assert sorted(set(names) - set(covered)) == ["Flatten_47"]
    assert covered["Add_6"].name == "Conv_5 + Add_6 + Relu_7"
    assert covered["Relu_7"] is covered["Conv_5"]
    # the parser's default (no node list) finds the same nodes
    assert set(by_onnx_node(parse_engine_info(RESNET))) == set(covered)


def test_qat_layers_drop_initializers_and_tensorrt_internal_names():
    layers = parse_engine_info(QAT[0])
    head = next(layer for layer in layers if "Gemm_864" in layer.name)
    assert head.onnx_nodes == ["QuantizeLinear_860", "Gemm_864"]
    assert (head.precision, head.output_precision) == ("int8", "fp32")
    nodes = [n for layer in layers for n in layer.onnx_nodes]
    assert nodes and all(re.fullmatch(r"[A-Za-z]+_\d+", n) for n in nodes)
    assert len(nodes) == len(set(nodes))


def test_fp32_fp16_reformats_are_precision_boundaries():
    resnet = precision_boundaries(parse_engine_info(RESNET))
    assert [(b.boundary, b.for_layer) for b in resnet] == [
        (("fp32", "fp16"), "Conv_0 + Relu_1"), (("fp16", "fp32"), "reshape_after_Gemm_48")]
    # the layout-only "NoOp" reformats (FP16 -> FP16) are not boundaries
    assert sum(1 for layer in parse_engine_info(RESNET) if layer.is_reformat) > len(resnet)
    qat = precision_boundaries(parse_engine_info(QAT[0]))
    assert qat[0].name == "QuantizeLinear_2" and qat[0].boundary == ("fp32", "int8")
    assert ("fp32", "int8") in {b.boundary for b in qat[1:]}  # FP32 islands quantized again


@pytest.mark.slow
def test_precision_report_reads_an_engine_built_elsewhere(tmp_path):
    path, _ = _resnet18_onnx(tmp_path)
    report = precision_report(path, engine_info=RESNET)
    rows = {row.onnx_node: row for row in report.layers}
    assert rows["Conv_0"].exported == "fp32" and rows["Conv_0"].actual == "fp16"
    assert "reformats fp32->fp16" in rows["Conv_0"].note
    assert "fused into TensorRT layer 'Conv_5 + Add_6 + Relu_7'" in rows["Add_6"].note
    assert rows["Flatten_47"].actual is None and "not found" in rows["Flatten_47"].note
    compute = [row for row in report.layers if row.op_type not in ("Identity", "Flatten")]
    assert len(compute) == 48 and {row.actual for row in compute} == {"fp16"}


def test_bad_inspector_json_is_a_clear_error(tmp_path):
    assert trt_dtype("Thirty-two wide channel vectorized row major Int8 format") == "int8"
    names_only = tmp_path / "names.json"
    names_only.write_text('{"Layers": ["Conv_0 + Relu_1"], "Bindings": []}')
    with pytest.raises(EngineInfoError, match="profilingVerbosity=detailed"):
        parse_engine_info(str(names_only))
    with pytest.raises(EngineInfoError, match="cannot read"):
        parse_engine_info(str(tmp_path / "missing.json"))
