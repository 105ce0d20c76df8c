"""fxamp.audit through each front end: the same findings on ATen graphs (torch.export) as
on fx graphs, tiny BERT through the export front end, the CLI passing --frontend on."""
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxamp import RewriteConfig, audit

SRC = str(Path(__file__).resolve().parents[1] / "src")


def fxamp_cli(*args, cwd):
    """``python -m fxamp ...`` run from ``cwd`` on this checkout's sources."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, "-m", "fxamp", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300, env=env)


class Both(nn.Module):
    """One of each audit finding, in code both fx and torch.export take."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 20)  # dims 12, 20
        self.ln = nn.LayerNorm(20, eps=1e-12)  # underflow
        self.bn = nn.BatchNorm1d(20, eps=1e-6)  # subnormal
        self.gn = nn.GroupNorm(2, 4, eps=1e-9)  # underflow
        self.q = nn.Linear(20, 16)

    def forward(self, x, img, y):
        h = self.bn(self.ln(self.fc(x)))
        q = self.q(h)
        s = torch.exp(q @ q.transpose(0, 1))  # exp without max shift
        h2 = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-12)  # hand-written norm
        loss = F.binary_cross_entropy(torch.sigmoid(q), y)
        return s, h2.half(), self.gn(img), F.layer_norm(h, (20,), eps=1e-10), loss


def both_inputs():
    return torch.randn(6, 12), torch.randn(2, 4, 3, 3), torch.rand(6, 16)


@pytest.mark.slow
def test_fx_and_export_find_the_same_issues():
    torch.manual_seed(0)
    model = Both().eval()
    fx_findings = audit(model, both_inputs(), RewriteConfig.make(target="cpu", frontend="fx"))
    ex_findings = audit(model, both_inputs(),
                        RewriteConfig.make(target="cpu", frontend="export"))
    fx_codes = Counter((f.code, f.severity) for f in fx_findings)
    assert fx_codes == Counter((f.code, f.severity) for f in ex_findings)
    assert fx_codes[("norm-eps-underflow", "warning")] == 4  # ln, gn, F.layer_norm, by hand
    assert {code for code, _ in fx_codes} == {
        "dims-not-multiple-of-8", "norm-eps-underflow", "norm-eps-subnormal",
        "exp-without-max-shift", "explicit-cast", "binary-cross-entropy"}
    # the export graph's findings name ATen ops
    messages = " ".join(f.message for f in ex_findings)
    for op in ("aten.layer_norm eps=1e-12", "aten.group_norm eps=1e-09",
               "aten.batch_norm eps=1e-06", "aten.to.dtype(torch.float16)"):
        assert op in messages, messages


def test_banned_op_through_export_is_reported_not_raised():
    torch.manual_seed(0)
    findings = audit(Both().eval(), both_inputs(),
                     RewriteConfig.make(target="cuda", frontend="export"))
    bce = [f for f in findings if f.code == "binary-cross-entropy"]
    assert len(bce) == 1 and bce[0].severity == "error"


@pytest.mark.slow
def test_bert_through_export_gets_the_layer_norm_eps_warning():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    assert config.layer_norm_eps == 1e-12
    model = BertForSequenceClassification(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    findings = audit(model, (), RewriteConfig.make(example_kwargs={"input_ids": ids},
                                             frontend="export"))
    eps = [f for f in findings if f.code == "norm-eps-underflow"]
    # embeddings, attention output and layer output LayerNorms
    assert len(eps) == 3, [str(f) for f in findings]
    assert all("aten.layer_norm eps=1e-12" in f.message for f in eps)
    assert any("modeling_bert.py" in f.source for f in eps)


@pytest.mark.slow
def test_cli_audit_passes_the_front_end_on(tmp_path):
    (tmp_path / "ln_model.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 16)
                self.ln = nn.LayerNorm(16, eps=1e-12)

            def forward(self, x):
                return self.ln(self.fc(x))

        def factory():
            return M(), (torch.randn(4, 16),)
    """))
    for frontend, label in (("fx", "nn.LayerNorm"), ("export", "aten.layer_norm")):
        r = fxamp_cli("audit", "ln_model.py:factory", "--frontend", frontend, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "warning norm-eps-underflow " in r.stdout, r.stdout
        assert f"{label} eps=1e-12" in r.stdout, r.stdout
