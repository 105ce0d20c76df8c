"""fxamp.audit: each finding on a hand-written model, a clean model, torchvision, the CLI."""
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp import Finding, audit
from fxamp.passes.audit import audit_graph, summary

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).name


def by_code(findings, code):
    return [f for f in findings if f.code == code]


def one(findings, code, node):
    found = [f for f in findings if f.code == code and f.node == node]
    assert len(found) == 1, [str(f) for f in findings]
    f = found[0]
    assert HERE in f.source, f.source  # the source line is the model's, in this file
    return f


# -- dims ------------------------------------------------------------------------------------
class Dims(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)  # in_channels=3
        self.grouped = nn.Conv2d(16, 24, 3, padding=1, groups=2)  # per group 8 -> 12
        self.depthwise = nn.Conv2d(24, 24, 3, padding=1, groups=24)  # skipped
        self.ok = nn.Conv2d(24, 32, 1)
        self.fc = nn.Linear(32, 20)  # out_features=20
        self.w = nn.Parameter(torch.randn(20, 12))

    def forward(self, x, q, k):
        x = self.ok(self.depthwise(self.grouped(self.stem(x))))
        h = self.fc(x.mean(dim=(2, 3)))
        h2 = F.linear(h, self.w.t())  # weight (12, 20): in 20, out 12
        scores = q @ k.transpose(-2, -1)  # (2, 6, 12) @ (2, 12, 6): K=12, N=6
        return h2, scores


def dims_inputs():
    return torch.randn(2, 3, 8, 8), torch.randn(2, 6, 12), torch.randn(2, 6, 12)


def test_dims_not_multiple_of_8():
    findings = audit(Dims(), dims_inputs())
    dims = by_code(findings, "dims-not-multiple-of-8")
    assert {f.node for f in dims} == {"stem", "grouped", "fc", "linear", "matmul"}
    assert all(f.severity == "info" for f in dims)
    stem = one(findings, "dims-not-multiple-of-8", "stem")
    assert "in_channels=3" in stem.message and "out_channels" not in stem.message
    assert "nn.Conv2d" in stem.message and "fp16" in stem.message
    assert "3 -> 8" in stem.fix
    grouped = one(findings, "dims-not-multiple-of-8", "grouped")
    assert "out_channels per group=12" in grouped.message
    assert "in_channels" not in grouped.message
    fc = one(findings, "dims-not-multiple-of-8", "fc")
    assert "out_features=20" in fc.message and "in_features" not in fc.message
    lin = one(findings, "dims-not-multiple-of-8", "linear")
    assert "in_features=20" in lin.message and "out_features=12" in lin.message
    mm = one(findings, "dims-not-multiple-of-8", "matmul")
    assert "inner dim K=12" in mm.message and "output columns N=6" in mm.message


def test_dims_only_where_the_node_computes_low():
    findings = audit(Dims(), dims_inputs(), "fp32:stem,fp32:fc")
    assert {f.node for f in by_code(findings, "dims-not-multiple-of-8")} == {
        "grouped", "linear", "matmul"}


# -- explicit casts --------------------------------------------------------------------------
class Casts(nn.Module):
    def forward(self, x):
        a = x.half().float()
        b = x.to(torch.float16).float()
        c = x.to(dtype=torch.bfloat16).float()
        d = x.bfloat16().float()
        e = x.type(torch.float16).float()
        f = x.type("torch.HalfTensor").float()
        g = x.to(torch.float64).float()  # not a low-precision cast
        return a + b + c + d + e + f + g


def test_explicit_casts():
    findings = audit(Casts(), (torch.randn(2, 8),))
    casts = by_code(findings, "explicit-cast")
    assert [f.node for f in casts] == ["half", "to", "to_1", "bfloat16", "type_1", "type_2"]
    assert all(f.severity == "warning" for f in casts)
    assert ".half() casts to fp16" in one(findings, "explicit-cast", "half").message
    assert ".to(torch.float16)" in one(findings, "explicit-cast", "to").message
    assert ".to(dtype=torch.bfloat16) casts to bf16" in one(findings, "explicit-cast",
                                                           "to_1").message
    assert ".type('torch.HalfTensor')" in one(findings, "explicit-cast", "type_2").message
    assert "let fxamp decide" in casts[0].fix
    assert len(findings) == len(casts)  # nothing else in this model


# -- binary_cross_entropy --------------------------------------------------------------------
class BCE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.loss = nn.BCELoss()

    def forward(self, x, y):
        p = torch.sigmoid(self.fc(x))
        return self.loss(p, y) + F.binary_cross_entropy(p, y)


def bce_inputs():
    return torch.randn(4, 16), torch.rand(4, 8)


@pytest.mark.parametrize("policy", [None, "numerics=off"])
def test_binary_cross_entropy_is_an_error_on_cuda(policy):
    if policy == "numerics=off":  # the rewrite alone refuses it: the audit must not
        with pytest.raises(fxamp.UnsupportedModelError):
            fxamp.amp_rewrite(BCE(), bce_inputs(),
                              fxamp.RewriteConfig.make(policy=policy, target="cuda"))
    findings = audit(BCE(), bce_inputs(),
                     fxamp.RewriteConfig.make(policy=policy, target="cuda"))
    bce = by_code(findings, "binary-cross-entropy")
    assert [f.node for f in bce] == ["loss", "binary_cross_entropy"]
    assert all(f.severity == "error" for f in bce)
    loss = one(findings, "binary-cross-entropy", "loss")
    assert "nn.BCELoss" in loss.message and "refuses" in loss.message
    assert "BCEWithLogitsLoss" in loss.fix
    assert "F.binary_cross_entropy" in one(findings, "binary-cross-entropy",
                                           "binary_cross_entropy").message


def test_binary_cross_entropy_is_a_warning_on_cpu():
    findings = audit(BCE(), bce_inputs(),
                     fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    bce = by_code(findings, "binary-cross-entropy")
    assert [f.severity for f in bce] == ["warning", "warning"]


# -- exp without max shift -------------------------------------------------------------------
class Attention(nn.Module):
    def forward(self, q, k, v):
        w = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)))
        out = (w @ v) / w.sum(-1, keepdim=True)
        s = torch.bmm(q, k.transpose(1, 2)) * 0.125
        safe = (s - s.amax(-1, keepdim=True)).exp()  # shifted: fine
        m = torch.einsum("bqd,bkd->bqk", q, k)
        safe2 = torch.exp(m - m.max(dim=-1, keepdim=True).values)  # shifted: fine
        return out, safe, safe2


def attn_inputs():
    return torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16)


@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_exp_without_max_shift(target):
    findings = audit(Attention(), attn_inputs(), fxamp.RewriteConfig.make(target=target))
    found = by_code(findings, "exp-without-max-shift")
    assert [f.node for f in found] == ["exp"]
    f = one(findings, "exp-without-max-shift", "exp")
    assert f.severity == "warning"
    assert "from matmul" in f.message and "11.09" in f.message and "65504" in f.message
    assert "softmax" in f.fix and "amax" in f.fix


def test_exp_of_a_hand_written_softmax_without_numerics_passes():
    class Softmax(nn.Module):
        def forward(self, q, k):
            e = (q @ k.transpose(-2, -1)).masked_fill(q[..., :1] > 5, -1e4).exp()
            return e / e.sum(-1, keepdim=True)

    findings = audit(Softmax(), attn_inputs()[:2], "numerics=off")
    assert [f.node for f in by_code(findings, "exp-without-max-shift")] == ["exp"]


def test_exp_in_bf16_is_info():
    findings = audit(Attention(), attn_inputs(), fxamp.RewriteConfig.make(dtype=torch.bfloat16))
    f = one(findings, "exp-without-max-shift", "exp")
    assert f.severity == "info" and "88.72" in f.message


# -- norm eps --------------------------------------------------------------------------------
class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16, eps=1e-12)  # 0 in fp16
        self.gn = nn.GroupNorm(2, 16, eps=1e-6)  # subnormal in fp16
        self.bn = nn.BatchNorm1d(16, eps=1e-3)  # fine
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x):
        x = self.ln(x)
        x = self.gn(x)
        x = self.bn(x)
        x = F.layer_norm(x, (16,), eps=1e-9)
        x = F.layer_norm(x, (16,), eps=1e-3)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12) * self.w


def test_norm_eps():
    findings = audit(Norms(), (torch.randn(4, 16),))
    under = by_code(findings, "norm-eps-underflow")
    assert [f.node for f in under] == ["ln", "layer_norm", "add"]
    assert all(f.severity == "warning" for f in under)
    ln = one(findings, "norm-eps-underflow", "ln")
    assert "nn.LayerNorm eps=1e-12" in ln.message and "fp16" in ln.message
    assert "6.1e-05" in ln.message and "ONNX/TensorRT" in ln.message
    assert "eps >= 6.1e-05" in ln.fix and "fp32:ln" in ln.fix
    assert "F.layer_norm eps=1e-09" in one(findings, "norm-eps-underflow",
                                           "layer_norm").message
    assert "hand-written" in one(findings, "norm-eps-underflow", "add").message
    sub = by_code(findings, "norm-eps-subnormal")
    assert [(f.node, f.severity) for f in sub] == [("gn", "info")]
    assert "nn.GroupNorm eps=1e-06" in sub[0].message and "export" in sub[0].fix


def test_norm_eps_in_bf16_is_fine():
    findings = audit(Norms(), (torch.randn(4, 16),),
                     fxamp.RewriteConfig.make(dtype=torch.bfloat16))
    assert not [f for f in findings if f.code.startswith("norm-eps")]


# -- a clean model, the API, torchvision, the CLI --------------------------------------------
class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16, eps=1e-3)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.ln = nn.LayerNorm(16, eps=1e-4)
        self.fc = nn.Linear(16, 32)

    def forward(self, x, y):
        h = F.relu(self.bn(self.conv(x)))
        h = self.ln(self.dw(h).mean(dim=(2, 3)))
        logits = self.fc(h)
        scores = torch.softmax(logits @ logits.t(), dim=-1)
        return F.binary_cross_entropy_with_logits(logits, y) + scores.sum(), h.float()


def test_clean_model_has_no_findings():
    model = Clean()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    findings = audit(model, (torch.randn(8, 8, 6, 6), torch.rand(8, 32)))
    assert findings == [], [str(f) for f in findings]
    after = model.state_dict()  # the audit changes nothing
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
               for k in before)
    assert not hasattr(model, "fxamp_result")


def test_finding_str_and_summary():
    f = Finding("error", "binary-cross-entropy", "loss", 'File "m.py", line 3, in f: x',
                "it is bad", "do better")
    assert str(f) == ('error binary-cross-entropy loss: it is bad (File "m.py", line 3, in f: '
                      'x) -> do better')
    assert str(Finding("info", "c", "n", "", "m", "f")) == "info c n: m -> f"
    warn = Finding("warning", "c", "n", "", "m", "f")
    assert summary([f, warn, warn]) == "3 findings: 1 error, 2 warnings"
    assert summary([warn]) == "1 finding: 1 warning"
    assert summary([]) == "0 findings"
    with pytest.raises(Exception):
        f.severity = "info"  # frozen


def test_audit_graph_reads_a_rewritten_graph():
    gm = fxamp.amp_rewrite(Dims(), dims_inputs())
    policy = fxamp.Policy()
    findings = audit_graph(gm, fxamp.plan_of(gm), policy)
    assert findings == audit(Dims(), dims_inputs())


def test_untraceable_model_raises():
    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(fxamp.TraceError):
        audit(Branchy(), (torch.randn(2),))


@pytest.mark.slow
def test_torchvision_resnet18():
    import torchvision
    model = torchvision.models.resnet18(num_classes=10)
    findings = audit(model, (torch.randn(1, 3, 64, 64),))
    dims = by_code(findings, "dims-not-multiple-of-8")
    assert {f.node: f.message.split(" with ")[1].split(":")[0] for f in dims} == {
        "conv1": "in_channels=3", "fc": "out_features=10"}
    assert all("resnet.py" in f.source for f in findings)
    eps = by_code(findings, "norm-eps-subnormal")  # BatchNorm's default 1e-5 in fp16
    assert len(eps) == 20 and all("eps=1e-05" in f.message for f in eps)
    assert {f.code for f in findings} == {"dims-not-multiple-of-8", "norm-eps-subnormal"}
    assert not [f for f in findings if f.severity != "info"]


def fxamp_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "fxamp", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_cli_audit_small_cnn():
    r = fxamp_cli("audit", "fxamp.demo:small_cnn")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(l.startswith("info dims-not-multiple-of-8 conv1: ") and "in_channels=1" in l
               for l in lines)
    assert lines[-1].startswith(f"{len(lines) - 1} findings: ")


@pytest.mark.slow
def test_cli_audit_error_exits_1_and_bad_input_exits_2(tmp_path):
    (tmp_path / "bce_model.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 16)
                self.loss = nn.BCELoss()

            def forward(self, x, y):
                return self.loss(torch.sigmoid(self.fc(x).half().float()), y)

        def factory():
            return M(), (torch.randn(4, 16), torch.rand(4, 16))
    """))
    r = fxamp_cli("audit", "bce_model:factory", "--policy", "numerics=off", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "error binary-cross-entropy loss: " in r.stdout
    assert "warning explicit-cast half: " in r.stdout
    assert "bce_model.py" in r.stdout
    assert r.stdout.splitlines()[-1] == "2 findings: 1 error, 1 warning"
    bad = fxamp_cli("audit", "no_such_module:factory", cwd=tmp_path)
    assert bad.returncode == 2 and "fxamp audit: error:" in bad.stderr
