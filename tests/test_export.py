"""ONNX export and precision reports, with the real exporter and onnxruntime (no mocks)."""
from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402,F401 - installed by the test extra: missing fails
import onnxscript  # noqa: E402,F401 - the dynamo exporter needs it

import fxamp  # noqa: E402
from fxamp.export import (SCHEMA, BackendUnavailableError, NumericsError,  # noqa: E402
                          PrecisionReport, check_numerics, export_onnx, precision_report,
                          tensorrt_available)
from fxamp.export.repairs import value_types  # noqa: E402


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(x.mean(dim=(2, 3)))


class Block(nn.Module):
    """Transformer-ish: LayerNorm(eps=1e-12), attention by matmul/softmax, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16, eps=1e-12)
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1)
        return x + self.proj(attn @ v)


class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        return self.out(y)


MODELS = {"cnn": (CNN, (2, 3, 8, 8)), "block": (Block, (2, 5, 16)), "up": (Up, (1, 3, 8, 8))}


# exports the MODELS to ONNX once (seconds): the tests taking it are marked slow
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (fp32 model, inputs, rewritten gm, onnx path, report)."""
    out = {}
    root = tmp_path_factory.mktemp("onnx")
    for name, (cls, shape) in MODELS.items():
        torch.manual_seed(0)
        model = cls().eval()
        if name == "cnn":  # non-trivial BatchNorm statistics
            model.bn.running_mean.uniform_(-0.5, 0.5)
            model.bn.running_var.uniform_(0.5, 2.0)
        inputs = (torch.randn(*shape),)
        gm = fxamp.amp_rewrite(model, inputs,
                               fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda"))
        path = export_onnx(gm, inputs, str(root / f"{name}.onnx"))
        report = precision_report(path, fxamp.plan_of(gm), backend="onnxruntime",
                                  inputs=inputs, reference=model)
        out[name] = (model, inputs, gm, path, report)
    return out


def _compute_inputs(path):
    model = onnx.load(path)
    types = value_types(model)
    return model, types


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_heavy_ops_take_the_planned_dtype(exported, name):
    _, _, gm, path, _ = exported[name]
    plan = fxamp.plan_of(gm)
    model, types = _compute_inputs(path)
    meta = dict((p.key, p.value) for p in model.metadata_props)
    assert meta["fxamp.exporter"] == "dynamo"
    assert meta["fxamp.checked_inputs"] == "2"  # run against PyTorch on two inputs
    fp16, checked = onnx.TensorProto.FLOAT16, 0
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        fx_node = meta.get("fxamp.fx_node")
        if node.op_type not in ("Conv", "Gemm", "MatMul") or fx_node not in plan.nodes:
            continue
        planned = plan.nodes[fx_node]  # a Conv with a BatchNorm folded in maps to the BN
        assert (planned.inputs or planned.dtype) == torch.float16
        assert [types[i] for i in node.input if i] == [fp16] * len([i for i in node.input if i])
        checked += 1
    assert checked >= 2
    # FP32 islands stay FP32: LayerNorm, softmax, bilinear interpolate
    islands = {"LayerNormalization", "Softmax", "Resize"}
    for node in model.graph.node:
        if node.op_type in islands:
            assert types[node.input[0]] == onnx.TensorProto.FLOAT, node.name
    # weights are FP16 initializers (the exporter folds weight.to(fp16); fxamp repairs the
    # FP32 weights the exporter's BatchNorm folding leaves on an FP16 Conv)
    inits = {i.name: i.data_type for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            assert all(inits[i] == fp16 for i in node.input[1:] if i in inits), node.name


@pytest.mark.slow
def test_batchnorm_is_folded_into_fp16_weights_so_onnxruntime_loads_it(exported):
    # the exporter's optimizer would fold it into FP32 initializers next to an FP16 input (an
    # invalid model); fxamp folds it first, from the FP32 values, into FP16 ones
    model = onnx.load(exported["cnn"][3])
    meta = {p.key: p.value for p in model.metadata_props}
    assert int(meta["fxamp.folded_batchnorms"]) >= 1
    inits = {i.name: i for i in model.graph.initializer}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert convs and all(inits[n.input[1]].data_type == onnx.TensorProto.FLOAT16
                         for n in convs)
    assert not [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_zero_eps(exported, name):
    model = onnx.load(exported[name][3])
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name in ("epsilon", "eps"):
                assert attr.f > 0.0, node.name
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node
                                               if n.op_type == "Constant" for a in n.attribute]
    adds = {i for n in model.graph.node if n.op_type == "Add" for i in n.input}
    for tensor in tensors:
        if tensor.data_type == onnx.TensorProto.FLOAT16 and tensor.name in adds:
            array = onnx.numpy_helper.to_array(tensor)
            assert not (array.size == 1 and float(array.reshape(-1)[0]) == 0.0), tensor.name
    if name == "block":  # LayerNorm's eps=1e-12 is an FP32 attribute: kept, not 0
        (ln,) = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
        eps = [a.f for a in ln.attribute if a.name == "epsilon"][0]
        assert eps == pytest.approx(1e-12, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_onnxruntime_matches_fp32_pytorch(exported, name):
    # FP16 rounds to 11 significant bits (relative 4.9e-4) at every cast; onnxruntime's CPU
    # provider then computes in FP32 on the FP16-rounded weights and activations. Measured
    # max abs errors are 1e-4..5e-4 on outputs of magnitude ~1; 1e-2 + 1e-2 * max|ref| leaves
    # a 20x margin while still catching a wrong layer or a lost FP32 island.
    model, inputs, _, path, report = exported[name]
    rows = check_numerics(path, model, inputs, rtol=1e-2, atol=1e-2)
    assert all(r["ok"] for r in rows)
    assert max(r["max_abs"] for r in rows) < 2e-3
    assert report.numerics and all(r["ok"] for r in report.numerics)


@pytest.mark.slow
def test_numerics_over_tolerance_raises(exported):
    model, inputs, _, path, _ = exported["block"]
    with pytest.raises(NumericsError, match="differs from the FP32 model") as info:
        check_numerics(path, model, inputs, rtol=0.0, atol=0.0)
    assert isinstance(info.value, fxamp.FxampError)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_report_maps_layers_back_to_fx_nodes(exported, name):
    _, _, gm, _, report = exported[name]
    plan = fxamp.plan_of(gm)
    mapped = len(report.mapped) / len(report.layers)
    assert mapped >= 0.9, report.to_markdown()  # measured: cnn 12/12, block 15/16, up 8/8
    gm_names = {n.name for n in gm.graph.nodes}
    assert all(layer.fx_node in gm_names for layer in report.mapped)
    heavy = [layer for layer in report.layers if layer.op_type in ("Conv", "Gemm", "MatMul")]
    for layer in heavy:  # every heavy op is traced to its fx node and module
        assert layer.fx_node in plan.nodes and layer.planned == "fp16"
        assert layer.exported == "fp16"
    modules = {layer.module for layer in heavy}
    assert modules & {"conv", "fc", "qkv", "proj", "out", "bn"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cpu_provider_fallbacks_are_listed(exported, name):
    """onnxruntime's CPU provider has no FP16 Conv/MatMul/Gemm kernels here: it inserts
    "InsertedPrecisionFreeCast" nodes and runs them in FP32. They are the fallbacks."""
    _, _, _, _, report = exported[name]
    assert report.backend == "onnxruntime" and report.device == "CPUExecutionProvider"
    heavy = [layer for layer in report.layers if layer.op_type in ("Conv", "Gemm", "MatMul")]
    assert heavy
    for layer in heavy:
        assert layer.fallback and layer.actual == "fp32" and layer in report.fallbacks
        assert "runs it in fp32" in layer.note
    # ops with FP16 weights get a Cast inserted before them; ops fed by values onnxruntime
    # already moved to FP32 (attention's q @ k^T) just follow them
    weighted = [layer for layer in heavy if layer.op_type in ("Conv", "Gemm")
                or layer.fx_node in ("qkv", "proj")]
    assert weighted and all("Cast inserted" in layer.note for layer in weighted)
    # the FP32 islands are where the plan put them: no fallback
    for layer in report.layers:
        if layer.op_type in ("LayerNormalization", "Softmax", "Resize"):
            assert not layer.fallback and layer.actual == "fp32"
    assert all(layer.planned and layer.actual != layer.planned for layer in report.fallbacks)


@pytest.mark.slow
def test_report_formats(exported):
    report = exported["block"][4]
    data = json.loads(report.to_json())
    assert data["schema"] == SCHEMA == "fxamp.precision_report/1"
    assert data["summary"]["fallbacks"] == len(report.fallbacks) > 0
    again = PrecisionReport.from_json(report.to_json())
    assert again == report and again.to_json() == report.to_json()

    md = report.to_markdown()
    assert md.startswith("**fxamp precision report**")
    assert "| | onnx node | op | fx node | module | planned | exported | actual | note |" in md
    rows = [line for line in md.splitlines() if line.startswith("| **fallback**")]
    assert len(rows) == len(report.fallbacks)
    table = md[md.index("| | onnx node"):].splitlines()[2:]
    assert table[:len(rows)] == rows  # fallbacks first

    page = report.to_html()
    checker = _TagChecker()
    checker.feed(page)
    checker.close()
    assert checker.stack == [] and checker.errors == []
    assert page.count('class="fallback') == len(report.fallbacks)
    assert 'class="fallback dt-fp32"' in page and '<tr class="dt-fp32">' in page


class _TagChecker(HTMLParser):
    VOID = {"meta", "br", "img", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list = []
        self.errors: list = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


@pytest.mark.slow
@pytest.mark.skipif(tensorrt_available(), reason="TensorRT and a CUDA GPU are available")
def test_tensorrt_backend_says_what_to_install(exported):
    path = exported["cnn"][3]
    with pytest.raises(BackendUnavailableError, match="pip install tensorrt") as info:
        precision_report(path, backend="tensorrt")
    assert "GPU" in str(info.value) and isinstance(info.value, fxamp.FxampError)
    assert precision_report(path, backend="auto").backend == "onnxruntime"


@pytest.mark.skipif(not tensorrt_available(),
                    reason="TensorRT and a CUDA GPU are not available")
@pytest.mark.slow
def test_tensorrt_backend(exported):  # pragma: no cover - needs TensorRT and a GPU
    _, _, gm, path, _ = exported["cnn"]
    report = precision_report(path, fxamp.plan_of(gm), backend="tensorrt")
    convs = [layer for layer in report.layers if layer.op_type == "Conv"]
    assert convs and all(layer.actual == "fp16" for layer in convs)


@pytest.mark.slow
def test_plan_is_read_from_the_file(exported):
    _, inputs, _, path, report = exported["up"]
    again = precision_report(path, backend="onnxruntime", inputs=inputs)
    assert [(x.onnx_node, x.planned, x.actual) for x in again.layers] == \
        [(x.onnx_node, x.planned, x.actual) for x in report.layers]


def test_torchscript_exporter_fallback(tmp_path):
    torch.manual_seed(0)
    model, inputs = Block().eval(), (torch.randn(2, 5, 16),)
    gm = fxamp.amp_rewrite(model, inputs)
    path = export_onnx(gm, inputs, str(tmp_path / "ts.onnx"), exporter="torchscript")
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert meta["fxamp.exporter"] == "torchscript" and meta["fxamp.checked_inputs"] == "2"
    check_numerics(path, model, inputs)


@pytest.mark.slow
def test_import_fxamp_does_not_import_onnx():
    code = ("import fxamp, sys; assert 'onnx' not in sys.modules and 'onnxruntime' not in "
            "sys.modules; import fxamp.export; assert 'onnx' not in sys.modules and "
            "'onnxruntime' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_cli_export(tmp_path, monkeypatch, capsys):
    from fxamp.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"an older export")  # replaced atomically
    assert main(["export", "fxamp.demo:small_cnn", "-o", "model.onnx", "--report",
                 "report.md"]) == 0
    captured = capsys.readouterr()
    assert "fxamp export: exporting to model.onnx" in captured.err
    assert "fxamp export: running the model on backend auto" in captured.err
    onnx.checker.check_model(onnx.load(str(tmp_path / "model.onnx")))
    text = (tmp_path / "report.md").read_text()
    assert "| | onnx node | op | fx node |" in text and "within tolerance" in text
    assert main(["export", "fxamp.demo:small_cnn", "-o", "new/m2.onnx", "--report",
                 "reports/r.json", "--backend", "onnxruntime"]) == 0  # directories made
    assert json.loads((tmp_path / "reports" / "r.json").read_text())["schema"] == SCHEMA
    onnx.checker.check_model(onnx.load(str(tmp_path / "new" / "m2.onnx")))
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


class RMSHead(nn.Module):
    """A hand-written RMSNorm whose eps (1e-12) the exporter's optimizer deletes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-12)


@pytest.mark.slow
def test_eps_the_exporter_deletes_is_put_back(tmp_path):
    torch.manual_seed(0)
    model = RMSHead().eval()
    x = torch.randn(3, 8)
    x[1] = 0.0  # a zero row: without eps, rsqrt(0) = inf and 0 * inf = NaN
    gm = fxamp.amp_rewrite(model, (x,))
    path = export_onnx(gm, (x,), str(tmp_path / "rms.onnx"))
    proto = onnx.load(path)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["fxamp.restored_eps_adds"] == "1"
    (add,) = [n for n in proto.graph.node if n.op_type == "Add"]
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    assert float(inits[add.input[1]]) == pytest.approx(1e-12, rel=1e-6)
    rows = check_numerics(path, model, (x,))  # raises on NaN
    assert all(r["ok"] for r in rows)


@pytest.mark.slow
def test_large_weights_become_fp16_initializers(tmp_path):
    # onnxscript folds constants only up to 8192 elements: a 512x512 weight would stay an
    # FP32 initializer behind a runtime Cast; fxamp folds it into an FP16 initializer
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4)).eval()
    inputs = (torch.randn(2, 512),)
    gm = fxamp.amp_rewrite(model, inputs)
    path = export_onnx(gm, inputs, str(tmp_path / "mlp.onnx"))
    proto = onnx.load(path)
    inits = {i.name: i for i in proto.graph.initializer}
    assert all(i.data_type == onnx.TensorProto.FLOAT16 for i in inits.values())
    assert not [n for n in proto.graph.node if n.op_type == "Cast" and n.input[0] in inits]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert int(meta["fxamp.folded_weight_casts"]) >= 1
    check_numerics(path, model, inputs)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Opaque(nn.Module):
    """A custom autograd Function (fenced in FP32) and a composite module run under
    torch.autocast by the rewritten graph (rule "runtime")."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = _Square.apply(self.fc(x))
        return self.mha(h, h, h, need_weights=False)[0]


@pytest.mark.slow
def test_opaque_calls_export_and_map_by_module_scope(tmp_path):
    torch.manual_seed(0)
    model, inputs = Opaque().eval(), (torch.randn(2, 3, 8),)
    gm = fxamp.amp_rewrite(model, inputs)
    plan = fxamp.plan_of(gm)
    assert plan.nodes["mha"].rule == "runtime"
    path = export_onnx(gm, inputs, str(tmp_path / "opaque.onnx"))
    report = precision_report(path, plan, backend="onnxruntime", inputs=inputs,
                              reference=model)
    assert all(r["ok"] for r in report.numerics)
    assert len(report.mapped) / len(report.layers) >= 0.9  # measured 37/37
    inside = [layer for layer in report.layers if layer.fx_node == "mha"]
    assert inside and all(layer.planned is None for layer in inside)  # autocast decides
    (square,) = [layer for layer in report.layers if layer.fx_node == "_square_apply"
                 or (layer.fx_node or "").endswith("square_apply")]
    assert square.planned == square.exported == "fp32"


class _Deep(nn.Module):
    """A hooked (opaque, rule "runtime") Linear two modules deep: enc.blocks.0."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Module()
        self.enc.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU())])
        self.enc.blocks[0].register_forward_hook(lambda m, i, o: None)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc.blocks[0](x))


@pytest.mark.slow
def test_module_paths_from_nested_onnx_scopes_are_not_doubled(tmp_path):
    """The dynamo exporter records scopes by full path ('enc', 'enc.blocks', ...): the
    report's module column is that path (was 'enc.enc.blocks...', as 'bert.bert.embeddings'
    on BERT) and ONNX nodes inside a nested opaque call map to its plan node."""
    torch.manual_seed(0)
    model, inputs = _Deep().eval(), (torch.randn(4, 8),)
    gm = fxamp.amp_rewrite(model, inputs)
    plan = fxamp.plan_of(gm)
    (hooked,) = [n for n, p in plan.nodes.items() if p.module == "enc.blocks.0"]
    assert plan.nodes[hooked].rule == "runtime"
    path = export_onnx(gm, inputs, str(tmp_path / "deep.onnx"))
    report = precision_report(path, plan, backend="onnxruntime", inputs=inputs)
    names = {name for name, _ in model.named_modules()}
    from fxamp.export.onnx_export import _scope_paths
    scoped = [_scope_paths(node) for node in onnx.load(path).graph.node]
    assert [p for p in scoped if p], "the exporter recorded no scopes"
    for paths in scoped:  # each scope is a real module path, outermost first
        assert set(paths) <= names and paths == sorted(paths, key=len), paths
    modules = {layer.module for layer in report.layers}
    assert modules <= names | {""} and {"enc.blocks.0", "head"} <= modules, modules
    inside = [layer for layer in report.layers if layer.module == "enc.blocks.0"]
    assert inside and all(layer.fx_node == hooked for layer in inside)
