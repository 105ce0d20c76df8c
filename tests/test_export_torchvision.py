"""`fxamp export` on a torchvision model writes the ONNX and a report a reviewer can read."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # exports torchvision's ResNet-18 through the CLI


def test_export_resnet18_with_a_json_report(tmp_path):
    onnx_path, report = tmp_path / "r18.onnx", tmp_path / "r18.json"
    r = subprocess.run([sys.executable, "-m", "fxamp", "export", "torchvision.models:resnet18",
                        "--input-shape", "1,3,64,64", "-o", str(onnx_path), "--report",
                        str(report)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "fxamp export: exporting" in r.stderr  # progress lines
    data = json.loads(report.read_text())
    assert data["schema"] == "fxamp.precision_report/1"
    layers = data["layers"]
    mapped = sum(1 for layer in layers if layer["fx_node"])
    assert len(layers) > 50 and mapped / len(layers) >= 0.9
    convs = [layer for layer in layers if layer["op_type"] == "Conv"]
    assert convs and all(layer["planned"] == "fp16" and layer["exported"] == "fp16"
                         for layer in convs)
    # onnxruntime's CPU provider has no fp16 Conv kernel: every Conv is a reported fallback
    assert all(layer["fallback"] and layer["actual"] == "fp32" for layer in convs)
    assert data["numerics"] and all(out["ok"] for out in data["numerics"])
