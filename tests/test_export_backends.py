"""Export backends behind one registry: one vocabulary of names for the precision report,
the support tables and the CLI (fxamp.export.backends)."""
from __future__ import annotations

import argparse

import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import fxamp  # noqa: E402
from fxamp.cli import build_parser  # noqa: E402
from fxamp.config import FRONTENDS  # noqa: E402
from fxamp.export import (BackendUnavailableError, UnknownBackendError,  # noqa: E402
                          precision_report, predict, tensorrt_available)
from fxamp.export.backends import (ALIASES, CHOICES, ONNXRUNTIME, REGISTRY,  # noqa: E402
                                   TENSORRT, Backend, choose, get_backend)
from fxamp.export.predict import BACKENDS, SOURCES  # noqa: E402
from fxamp.policy import TARGETS  # noqa: E402


def _choices(command: str, flag: str) -> list:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if flag in a.option_strings)
    return list(action.choices)


def test_every_backend_has_a_name_availability_a_runner_and_a_table():
    assert list(REGISTRY) == ["tensorrt", "onnxruntime"]
    for name, backend in REGISTRY.items():
        assert isinstance(backend, Backend) and backend.name == name
        assert backend.table in SOURCES and backend.missing.startswith(f"backend='{name}'")
        assert isinstance(backend.available(), bool)
    assert ONNXRUNTIME.available()  # imported above
    assert TENSORRT.available() is tensorrt_available()
    assert BACKENDS == tuple(b.table for b in REGISTRY.values())


def test_cli_choices_come_from_the_registries():
    assert _choices("export", "--backend") == list(CHOICES) == ["auto", "onnxruntime",
                                                                "tensorrt"]
    for command in ("plan", "export", "show", "audit"):
        assert _choices(command, "--frontend") == list(FRONTENDS)
        assert _choices(command, "--target") == list(TARGETS)


@pytest.mark.parametrize("op", ["GridSample", "MatMul", "Resize", "NoSuchOp"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_one_vocabulary_the_backend_name_and_the_old_table_name_agree(op, dtype):
    by_name = predict(op, "onnxruntime", dtype)
    by_alias = predict(op, "onnxruntime-cuda", dtype)
    assert by_name == by_alias == ONNXRUNTIME.support(op, dtype)
    assert by_name.backend == "onnxruntime-cuda"  # the key reports record predictions under
    assert predict(op, "tensorrt", dtype) == TENSORRT.support(op, dtype)


def test_unknown_backend_names_list_the_valid_ones():
    with pytest.raises(UnknownBackendError, match="backend must be onnxruntime or tensorrt, "
                       "got 'openvino'"):
        get_backend("openvino")
    with pytest.raises(ValueError):
        predict("Conv", "openvino")
    with pytest.raises(fxamp.FxampError, match="onnxruntime, tensorrt or auto"):
        choose("ort")
    assert get_backend("onnxruntime-cuda") is ONNXRUNTIME
    assert all(get_backend(alias) is REGISTRY[name] for alias, (name, _) in ALIASES.items())


@pytest.fixture
def tiny_onnx(tmp_path):
    """A real two-node FP32 ONNX file (no fxamp plan in it)."""
    from onnx import TensorProto, helper

    f32 = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                               helper.make_node("Add", ["r", "x"], ["y"], name="add")], "g",
                              [helper.make_tensor_value_info("x", f32, [2, 3])],
                              [helper.make_tensor_value_info("y", f32, [2, 3])])
    path = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_precision_report_runs_the_chosen_backend(tiny_onnx):
    report = precision_report(tiny_onnx, backend="onnxruntime")
    assert report.backend == "onnxruntime"
    assert [layer.actual for layer in report.layers] == ["fp32", "fp32"]
    if not tensorrt_available():
        assert precision_report(tiny_onnx, backend="auto").backend == "onnxruntime"
        with pytest.raises(BackendUnavailableError, match="pip install tensorrt"):
            precision_report(tiny_onnx, backend="tensorrt")


def test_the_old_name_runs_onnxruntime_on_its_cuda_provider(tiny_onnx):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        report = precision_report(tiny_onnx, backend="onnxruntime-cuda")
        assert (report.backend, report.device) == ("onnxruntime", "CUDAExecutionProvider")
    else:  # asked for CUDA, none here: refused loudly, not run on the CPU instead
        with pytest.raises(BackendUnavailableError, match="CUDAExecutionProvider is not "
                           "available"):
            precision_report(tiny_onnx, backend="onnxruntime-cuda")
