"""``fxamp plan`` to stdout writes the plan alone (what the model's code prints goes to
stderr, so ``fxamp plan ... > model.plan`` is a file ``check`` reads), and a model that
fails on --input-shape's random FP32 inputs gets the command's advice: a factory returning
(model, inputs)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxamp import Plan
from fxamp.cli import main

ROOT = Path(__file__).resolve().parents[1]

FACTORIES = """
    import torch
    import torch.nn as nn

    class Loud(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            print("the forward prints")
            return self.lin(x)

    def loud():
        print("the factory prints")
        return Loud(), (torch.randn(2, 8),)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.lin = nn.Linear(8, 4)

        def forward(self, ids):
            return self.lin(self.emb(ids))

    def tokens():
        return Tokens()
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "printing_models.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.delitem(sys.modules, "printing_models", raising=False)
    return tmp_path


def _env():
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + paths))


@pytest.mark.slow  # (a subprocess: stdout as a shell redirect sees it)
def test_plan_to_stdout_is_the_plan_alone_and_the_prints_go_to_stderr(factories):
    r = subprocess.run([sys.executable, "-m", "fxamp", "plan", "printing_models:loud",
                        "--dtype", "bf16", "--target", "cpu"], capture_output=True,
                       text=True, cwd=factories, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr
    assert "prints" not in r.stdout
    assert "the factory prints" in r.stderr and "the forward prints" in r.stderr
    plan = Plan.from_text(r.stdout)
    assert plan.nodes
    (factories / "model.plan").write_text(r.stdout)
    check = subprocess.run([sys.executable, "-m", "fxamp", "check", "printing_models:loud",
                            "--plan", "model.plan", "--dtype", "bf16", "--target", "cpu"],
                           capture_output=True, text=True, cwd=factories, timeout=300,
                           env=_env())
    assert check.returncode == 0, check.stderr


def test_plan_in_process_keeps_stdout_the_plan(factories, capsys):
    assert main(["plan", "printing_models:loud", "--dtype", "bf16", "--target", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert Plan.from_text(out).nodes
    assert "the factory prints" in err and "the forward prints" in err


def test_input_shape_for_a_token_model_advises_a_factory_returning_its_inputs(factories,
                                                                             capsys):
    assert main(["plan", "printing_models:tokens", "--input-shape", "2,5"]) == 2
    err = capsys.readouterr().err
    assert "Expected tensor for argument #1 'indices'" in err  # the real cause
    assert "make printing_models:tokens return (model, example_inputs)" in err
    assert "leave out --input-shape" in err
    assert "example_kwargs" not in err and "model(*example_inputs)" not in err
