"""Static FP16/BF16 predictions from published operator tables (fxamp.export.predict)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxamp.export.predict import (BACKENDS, ORT_CUDA_TYPES, SOURCES, TENSORRT_TYPES,
                                  predict, predict_fp16, predicted_fallbacks)
from fxamp.export.report import LayerPrecision, PrecisionReport


def test_sources_are_named():
    assert set(SOURCES) == set(BACKENDS)
    assert SOURCES["tensorrt"]["path"] == "docs/operators.md"
    assert "10.15" in SOURCES["tensorrt"]["version"]
    assert SOURCES["onnxruntime-cuda"]["repo"] == "microsoft/onnxruntime"
    assert SOURCES["onnxruntime-cuda"]["commit"] == "001d12d2623fd411ce0f83d05abb5e82304a3389"
    assert len(TENSORRT_TYPES) > 150 and len(ORT_CUDA_TYPES) > 120


@pytest.mark.parametrize("op,backend,fp16,bf16", [
    # onnx-tensorrt docs/operators.md (TensorRT 10.15):
    #   "| Resize | Y | FP32, FP16, BF16 |", "| GridSample | Y | FP32, FP16 |",
    #   "| RoiAlign | Y | FP32, FP16 |", "| STFT | Y | FP32 |", "| Unique | N |",
    #   "| LayerNormalization | Y | FP32, FP16, BF16 |"
    ("Resize", "tensorrt", True, True),
    ("GridSample", "tensorrt", True, False),
    ("RoiAlign", "tensorrt", True, False),
    ("STFT", "tensorrt", False, False),
    ("Unique", "tensorrt", False, False),
    ("LayerNormalization", "tensorrt", True, True),
    # onnxruntime docs/OperatorKernels.md @ 001d12d, CUDAExecutionProvider, ai.onnx:
    #   "|GridSample|...|22+|**T1** = tensor(float)<br/> **T2** = tensor(float)|"
    #   "|Range|...|11+|**T** = tensor(double), tensor(float), tensor(int16), ..."
    #   "|RoiAlign|...|10+|**T1** = tensor(double), tensor(float)<br/> **T2** = tensor(int64)|"
    #   "|Resize|...|19+|**T1** = tensor(double), tensor(float), tensor(float16), ..."
    #   "|MatMul|...|13+|**T** = tensor(bfloat16), tensor(double), tensor(float), tensor(float16)|"
    #   "|TopK|...|11+|... **T** = tensor(double), tensor(float), tensor(float16), ..."
    #   NonMaxSuppression has no row in the CUDA section (Neg is followed by NonZero).
    ("GridSample", "onnxruntime-cuda", False, False),
    ("Range", "onnxruntime-cuda", False, False),
    ("RoiAlign", "onnxruntime-cuda", False, False),
    ("Resize", "onnxruntime-cuda", True, False),
    ("MatMul", "onnxruntime-cuda", True, True),
    ("TopK", "onnxruntime-cuda", True, False),
    ("NonMaxSuppression", "onnxruntime-cuda", False, False),
])
def test_table_answers_what_the_source_says(op, backend, fp16, bf16):
    p = predict_fp16(op, backend)
    assert p.supported is fp16
    assert p.note.startswith(f"prediction ({SOURCES[backend]['short']})")
    assert p.source == SOURCES[backend]["short"]
    assert predict(op, backend, "bf16").supported is bf16


def test_unknown_op_is_none():
    for backend in BACKENDS:
        p = predict_fp16("NoSuchOp", backend)
        assert p.supported is None and "no prediction" in p.note
    assert predicted_fallbacks("NoSuchOp", "fp16") == {}
    with pytest.raises(ValueError):
        predict_fp16("Conv", "openvino")


def test_only_planned_low_precision_layers_get_predictions():
    assert predicted_fallbacks("GridSample", "fp32") == {}
    assert predicted_fallbacks("GridSample", None) == {}
    assert set(predicted_fallbacks("GridSample", "fp16")) == {"onnxruntime-cuda"}
    assert set(predicted_fallbacks("GridSample", "bf16")) == set(BACKENDS)
    assert predicted_fallbacks("Conv", "fp16") == {}


def test_old_json_without_predictions_still_loads():
    report = PrecisionReport(layers=[LayerPrecision("n", "Conv", planned="fp16")])
    data = json.loads(report.to_json())
    del data["layers"][0]["predictions"]
    again = PrecisionReport.from_json(json.dumps(data))
    assert again.layers[0].predictions == {}
    assert "Predicted fallbacks" not in again.to_markdown()


class Warp(nn.Module):
    """A conv feature map resampled by a grid that an FP16 conv computes: GridSample in
    FP16, which onnxruntime's CUDA provider does not register (TensorRT does)."""

    def __init__(self) -> None:
        super().__init__()
        self.feat = nn.Conv2d(3, 4, 3, padding=1)
        self.flow = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = torch.tanh(self.flow(x)).permute(0, 2, 3, 1)
        return F.grid_sample(self.feat(x), grid, align_corners=False)


@pytest.mark.slow
def test_report_marks_predicted_fallbacks(tmp_path):
    import fxamp
    from fxamp.export import export_onnx, precision_report

    torch.manual_seed(0)
    model = Warp().eval()
    inputs = (torch.randn(1, 3, 8, 8),)
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda"))
    path = export_onnx(gm, inputs, str(tmp_path / "warp.onnx"))
    report = precision_report(path, fxamp.plan_of(gm), backend="onnxruntime", inputs=inputs)
    grid = [layer for layer in report.layers if layer.op_type == "GridSample"]
    assert len(grid) == 1 and grid[0].planned == "fp16"  # CUDA lists: grid_sampler promotes
    layer = grid[0]
    assert set(layer.predictions) == {"onnxruntime-cuda"}
    note = layer.predictions["onnxruntime-cuda"]
    assert note.startswith("prediction (onnxruntime docs/OperatorKernels.md")
    assert "no FP16 GridSample" in note
    # Convs are FP16 on both backends: no prediction.
    assert all(not x.predictions for x in report.layers if x.op_type == "Conv")
    # JSON: the field is there and round-trips; predictions do not count as fallbacks.
    data = json.loads(report.to_json())
    row = next(r for r in data["layers"] if r["op_type"] == "GridSample")
    assert row["predictions"] == layer.predictions
    assert PrecisionReport.from_json(report.to_json()).predicted[0].onnx_node == layer.onnx_node
    md = report.to_markdown()
    section = md.split("**Predicted fallbacks (not measured)**", 1)[1]
    assert "GridSample" in section and "onnxruntime-cuda" in section and "prediction (" in section
    assert "Predicted fallbacks (not measured)" in report.to_html()
