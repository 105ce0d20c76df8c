"""Results of the eager front end (a model whose own forward no tracer takes): show and
audit read their rewritten children; export checks the traced graph against PyTorch on a
second input and refuses a wrong branch."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
import torch

import fxamp
from fxamp.export import export_onnx
from fxamp.show import render, shown_nodes

SRC = str(Path(__file__).resolve().parents[1] / "src")

MODEL = textwrap.dedent("""
    import torch, torch.nn as nn

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8, eps=1e-12)

        def forward(self, x):  # value-dependent: no tracer takes it
            if x.abs().max() > 1e6:  # a rare path: its norm is never called on the example
                return self.norm(x)
            return x if x.abs().sum() > 0 else -x  # the same way for -x

    class Branchy(nn.Module):
        def __init__(self, sign_branch=True):
            super().__init__()
            self.fc = nn.Linear(8, 8, bias=False)
            self.ln = nn.LayerNorm(8, eps=1e-12)
            self.gate = Gate()
            self.sign_branch = sign_branch

        def forward(self, x):
            h = self.ln(self.fc(x))
            h = self.gate(h) if h.abs().sum() > 0 else self.gate(-h)
            if self.sign_branch and h.sum() > 0:  # takes the other way for -x
                return h * 2
            return h

    def build():
        torch.manual_seed(0)
        return Branchy().eval(), (torch.randn(4, 8),)

    def build_branch_free():
        torch.manual_seed(0)
        return Branchy(sign_branch=False).eval(), (torch.randn(4, 8),)
""")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eager")
    (folder / "branchy.py").write_text(MODEL)
    sys.path.insert(0, str(folder))
    try:
        import branchy
    finally:
        sys.path.remove(str(folder))
    return folder, branchy


def rewrite(model, inputs):
    gm = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(target="cpu"))
    assert fxamp.plan_of(gm).header["frontend"] == "eager"
    return gm


def test_show_draws_the_rewritten_children_and_marks_runtime_parts(models):
    _, branchy = models
    model, inputs = branchy.build()
    gm = rewrite(model, inputs)
    nodes = {n.name: n for n in shown_nodes(gm, fxamp.plan_of(gm))}
    fc = [n for name, n in nodes.items() if name.startswith("fc/") and n.op == "F.linear"]
    assert len(fc) == 1 and fc[0].dtype == "fp16" and fc[0].module == "fc"
    assert nodes["gate"].rule == "runtime" and "torch.autocast" in nodes["gate"].reason
    # edges stay inside each child's graph
    assert all(i in nodes for n in nodes.values() for i in n.inputs)
    assert any(n.inputs for n in nodes.values())
    dot = render(gm, fxamp.plan_of(gm), "dot")
    assert f'"{fc[0].name}" [label=' in dot and '"gate" [label="gate\\n' in dot
    html = render(gm, fxamp.plan_of(gm), "html")
    assert 'data-node="gate"' in html and "runtime: not traceable" in html


@pytest.mark.slow
def test_audit_reads_the_children_and_the_runtime_parts(models):
    _, branchy = models
    model, inputs = branchy.build()
    findings = fxamp.audit(model, inputs, "target=cpu")
    by_node = {(f.code, f.node): f for f in findings}
    ln = by_node[("norm-eps-underflow", "ln/layer_norm")]
    assert "'fp32:ln/layer_norm'" in ln.fix
    assert ("runs-under-autocast", "gate") in by_node
    assert by_node[("norm-eps-underflow", "gate.norm")].severity == "warning"
    # the policy hint the audit gives matches a plan line
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(target="cpu", policy="fp32:ln/layer_norm"))
    assert fxamp.plan_of(gm).nodes["ln/layer_norm"].dtype == torch.float32


@pytest.mark.slow
def test_export_refuses_a_trace_that_takes_the_wrong_branch(models, tmp_path):
    _, branchy = models
    model, inputs = branchy.build()
    gm = rewrite(model, inputs)
    path = tmp_path / "branchy.onnx"
    with pytest.raises(fxamp.FxampError) as info:
        export_onnx(gm, inputs, str(path))
    text = str(info.value)
    assert "does not compute what the model computes on a second input" in text
    assert "what to do" in text
    assert not path.exists()


@pytest.mark.slow
def test_export_of_an_eager_result_is_checked_on_two_inputs(models, tmp_path):
    import onnxruntime as ort

    _, branchy = models
    model, inputs = branchy.build_branch_free()
    gm = rewrite(model, inputs)
    path = tmp_path / "ok.onnx"
    export_onnx(gm, inputs, str(path))
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta["fxamp.exporter"] == "torchscript" and meta["fxamp.checked_inputs"] == "2"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(4, 8) * 3  # a third input: the file computes what the model does
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(torch.from_numpy(got).float(), ref, rtol=0.02, atol=0.02)


def fxamp_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, "-m", "fxamp", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300, env=env)


@pytest.mark.slow
def test_cli_show_audit_export_on_an_eager_result(models):
    folder, _ = models
    show = fxamp_cli("show", "branchy.py:build", "--target", "cpu", "-o", "g.html", cwd=folder)
    assert show.returncode == 0, show.stderr
    assert 'data-node="gate"' in (folder / "g.html").read_text()
    audit = fxamp_cli("audit", "branchy.py:build", "--target", "cpu", cwd=folder)
    assert audit.returncode == 0, audit.stderr
    assert "info runs-under-autocast gate: " in audit.stdout
    assert "warning norm-eps-underflow ln/layer_norm: " in audit.stdout
    export = fxamp_cli("export", "branchy.py:build", "--target", "cpu", "-o", "b.onnx",
                       cwd=folder)
    assert export.returncode == 2, export.stderr
    assert "Traceback" not in export.stderr
    assert "does not compute what the model computes" in export.stderr
    assert not (folder / "b.onnx").exists()
