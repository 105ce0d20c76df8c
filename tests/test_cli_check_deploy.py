"""``fxamp check --target tensorrt`` plans from the model's own example; the committed plan's
@range lines only add calibration."""
import textwrap

from fxamp.cli import main

MODELS = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Large(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.up, self.norm, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)
            self.scale = scale

        def forward(self, x):
            return self.head(self.norm(self.up(x) * self.scale))

    def _make(scale):
        torch.manual_seed(0)
        return Large(scale).eval(), (torch.randn(4, 8),)

    def small():
        return _make(1.0)

    def large():
        return _make(5e4)
''')


def run(*argv):
    try:
        return main(list(argv))
    except SystemExit as stop:
        return stop.code


def test_check_judges_the_model_by_its_own_example_not_the_committed_ranges(tmp_path, capsys):
    models = tmp_path / "models_deploy.py"
    models.write_text(MODELS)
    plan = tmp_path / "small.plan"
    small, large = f"{models}:small", f"{models}:large"
    assert run("check", small, "--target", "tensorrt", "--plan", str(plan), "--update") == 0
    assert run("check", small, "--target", "tensorrt", "--plan", str(plan)) == 0
    capsys.readouterr()
    # the large model's own plan keeps nodes in FP32: it does not match the small one's
    assert run("check", large, "--target", "tensorrt", "--plan", str(plan)) == 1
    out = capsys.readouterr().out
    assert "fp32" in out and "reaches" in out
    # --update writes the large model's own plan, which then matches
    before = plan.read_text()
    assert run("check", large, "--target", "tensorrt", "--plan", str(plan), "--update") == 0
    assert plan.read_text() != before and "ranges" in plan.read_text()
    assert run("check", large, "--target", "tensorrt", "--plan", str(plan)) == 0
    # the committed ranges still count as calibration: with the large plan's ranges the small
    # model's plan keeps the same nodes in FP32 (and holds the same ranges): it matches
    assert run("check", small, "--target", "tensorrt", "--plan", str(plan)) == 0
