"""The fxamp command's exit status and messages: every failure is exit 2 with one clear
line (``--debug`` adds the traceback); 1 only for "the plan differs" and audit's error
findings. The command runs in-process (``main``), as the console script calls it."""
import itertools
import sys
import textwrap

import pytest
import torch

from fxamp.cli import main

_names = itertools.count()


def run(*argv):
    """The exit status of ``fxamp *argv`` (its output goes to capsys)."""
    try:
        return main(list(argv))
    except SystemExit as stop:  # argparse's own errors
        return stop.code


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Write a module of model factories in a fresh directory; returns its spec prefix."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source):
        name = f"cli_models_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name
    yield write


FACTORIES = """
    import torch
    import torch.nn as nn

    def good():
        return nn.Sequential(nn.Linear(8, 4), nn.ReLU()), (torch.randn(2, 8),)

    def only_model():
        return nn.Sequential(nn.Linear(8, 4), nn.ReLU())

    def raises():
        raise ValueError("the config file says batch=-1")

    def needs_args(depth, width=8):
        return nn.Linear(width, width)

    not_callable = 42

    def three():
        return nn.Linear(8, 4), (torch.randn(2, 8),), {"labels": None}

    def exits():
        raise SystemExit(3)
"""


@pytest.mark.parametrize("argv, says", [
    (["plan", "{m}:raises"], "{m}:raises raised ValueError: the config file says batch=-1 "
                             "({m}.py, line 12, in raises)"),
    (["plan", "{m}:needs_args"], "{m}:needs_args needs arguments (depth)"),
    (["plan", "{m}:not_callable"], "{m}:not_callable is an int, not callable"),
    (["plan", "{m}:three"], "{m}:three returned a tuple of 3 values (Linear, tuple, dict); "
                            "what to do: return a model (an nn.Module, with --input-shape) "
                            "or a pair (model, example_inputs)"),
    (["plan", "{m}:exits"], "{m}:exits called sys.exit(3)"),
    (["check", "{m}:raises", "--plan", "x.plan"], "{m}:raises raised ValueError"),
    (["audit", "{m}:needs_args"], "needs arguments (depth)"),
    (["show", "{m}:not_callable", "-o", "g.html"], "is an int, not callable"),
    (["plan", "{m}:only_model", "--input-shape", "100000,100000,100"],
     "{m}:only_model fails on FP32 inputs of --input-shape 100000,100000,100 (run on "
     "device meta, without data): RuntimeError: a and b must have same reduction dim"),
    (["plan", "{m}:only_model", "--input-shape", "2,-8"], "--input-shape sizes are integers "
                                                         "from 0 to 2**63-1, got -8"),
    (["plan", "{m}:only_model", "--input-shape", "99999999999999999999999,8"],
     "got 99999999999999999999999"),
    (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
])
def test_a_failing_factory_or_argument_exits_2_with_one_line(models, capsys, argv, says):
    m = models(FACTORIES)
    assert run(*[a.format(m=m) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    if lines[0].startswith("usage: "):  # argparse: the usage, then its one error line
        lines = lines[-1:]
    assert len(lines) == 1, err
    assert says.format(m=m) in lines[0]


@pytest.mark.parametrize("raised", ["RuntimeError('CUDA driver missing')",
                                    "ValueError('bad setting')", "KeyError('HOME')",
                                    "SystemExit(4)"])
def test_a_module_whose_import_raises_exits_2_naming_the_cause(models, capsys, raised):
    m = models(f"import torch\nraise {raised}\n")
    assert run("plan", f"{m}:build") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    kind = raised.split("(")[0]
    what = "called sys.exit(4)" if kind == "SystemExit" else f"raised {kind}"
    assert err.startswith(f"fxamp plan: error: cannot import '{m}': importing it {what}")
    assert f"({m}.py, line 2, in <module>)" in err and "--debug" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_prints_the_traceback_then_the_line(models, capsys, where):
    m = models(FACTORIES)
    argv = ["plan", f"{m}:raises"]
    argv = ["--debug"] + argv if where == "before" else argv + ["--debug"]
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in raises" in err
    assert err.strip().splitlines()[-1].startswith(f"fxamp plan: error: {m}:raises raised")


def test_an_unexpected_error_inside_fxamp_is_exit_2_too(models, capsys, tmp_path,
                                                       monkeypatch):
    """Not an FxampError (here: the Graphviz program fails on what it is given): one line
    with the type, the message and the place, and what to do."""
    m = models(FACTORIES)
    fake_dot = tmp_path / "bin" / "dot"
    fake_dot.parent.mkdir()
    fake_dot.write_text("#!/bin/sh\nexit 3\n")
    fake_dot.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_dot.parent), prepend=":")
    assert run("show", f"{m}:good", "-o", "g.svg") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fxamp show: error: unexpected CalledProcessError: Command")
    assert "run again with --debug for the traceback" in err


def test_exit_1_is_only_a_difference(models, capsys, tmp_path):
    m = models(FACTORIES)
    plan = str(tmp_path / "m.plan")
    assert run("check", f"{m}:good", "--plan", plan, "--update") == 0
    assert run("check", f"{m}:good", "--plan", plan) == 0
    assert run("check", f"{m}:good", "--plan", plan, "--policy", "fp32:_0") == 1
    assert run("check", f"{m}:raises", "--plan", plan) == 2


def _plan_text(m):
    import fxamp
    mod = __import__(m)
    return fxamp.plan_of(fxamp.amp_rewrite(*mod.good())).to_text()


def test_a_huge_end_marker_count_is_a_plan_error_not_a_crash(models, capsys, tmp_path):
    m = models(FACTORIES)
    text = _plan_text(m)
    good, bad = tmp_path / "good.plan", tmp_path / "bad.plan"
    good.write_text(text)
    bad.write_text(text.replace(text.splitlines()[-1], "# end of plan: " + "9" * 5000 +
                                " nodes, 0 ranges"))
    for argv in (["diff", str(good), str(bad)], ["check", f"{m}:good", "--plan", str(bad)]):
        assert run(*argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "line 10: the end marker's counts have more than " \
            "18 digits" in err, err
        assert len(err) < 1000  # the line is quoted cut to 200 characters


def test_a_huge_line_in_a_plan_file_is_not_echoed_whole(capsys, tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text("# fxamp precision plan v2\n# x" + "a" * 5_000_000 + "\n")
    assert run("diff", str(bad), str(bad)) == 2
    err = capsys.readouterr().err
    assert "line 2: header line must be '# key: value'" in err
    assert "... (5000003 characters, the first 200 shown)" in err and len(err) < 600
    bad.write_text("A" * 5_000_000)
    assert run("diff", str(bad), str(bad)) == 2
    err = capsys.readouterr().err
    assert "line 1: expected '# fxamp precision plan v2'" in err and len(err) < 600


def test_input_shape_plans_on_meta_tensors_without_allocating(models, capsys):
    """12 TB as real FP32 tensors: allocating it fails, so the plan is proof that none was
    allocated; it equals the plan of a small input."""
    m = models("""
        import torch.nn as nn
        def conv():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    """)
    with pytest.raises(RuntimeError):
        torch.empty(1, 3, 1_000_000, 1_000_000)
    for command in (["plan"], ["audit"]):
        assert run(*command, f"{m}:conv", "--input-shape", "1,3,1000000,1000000") == 0, \
            capsys.readouterr().err
        huge = capsys.readouterr().out
        assert run(*command, f"{m}:conv", "--input-shape", "1,3,16,16") == 0
        assert capsys.readouterr().out == huge
    assert "_0" in huge


def test_input_shape_falls_back_to_real_inputs_where_meta_cannot_run(models, capsys):
    m = models("""
        import torch
        import torch.nn as nn
        class Gate(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
            def forward(self, x):
                return self.fc(x) if float(x.abs().max()) < 1e9 else x
        def gate():
            return Gate()
    """)
    assert run("plan", f"{m}:gate", "--input-shape", "2,8") == 0, capsys.readouterr().err
    assert "nn.Linear" in capsys.readouterr().out
    assert run("plan", f"{m}:gate", "--input-shape", "100000,100000,8") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "run on device meta" in err and "320.0 GB" in err


def test_an_onnx_export_failure_prints_only_the_clear_error(models, capfd, caplog):
    """The TorchScript exporter's C++ log prints the graph at the exception (to descriptor
    1) before fxamp's error; the command shows only the error, --debug the captured text."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    m = models("""
        import torch
        import torch.nn as nn
        class Svd(nn.Module):
            def forward(self, x):
                return torch.linalg.svd(x)[0]
        def build():
            return Svd(), (torch.randn(3, 3),)
    """)
    assert run("export", f"{m}:build", "-o", "m.onnx") == 2
    out, err = capfd.readouterr()
    assert "both ONNX exporters failed" in err and "linalg_svd" in err and out == ""
    assert "Torch IR graph at exception" not in err and "Traceback" not in err
    assert [line for line in err.splitlines() if not line.startswith("fxamp export: ")] == []
    with caplog.at_level("DEBUG", logger="fxamp.cli.quiet"):  # what --debug shows
        assert run("--debug", "export", f"{m}:build", "-o", "m.onnx") == 2
    assert "Traceback" in capfd.readouterr().err
    assert "stdout of the failed step:\nTorch IR graph at exception" in caplog.text


def test_torch_fx_s_traceback_of_a_failing_step_is_kept_off_stderr(capfd):
    """torch.fx prints the generated forward's traceback to sys.stderr when a call fails
    in it; the step's output is shown only when it succeeds."""
    from fxamp.cli.quiet import quiet
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        quiet(gm)(torch.randn(3, 5))
    assert capfd.readouterr().err == ""
    with pytest.raises(RuntimeError):
        gm(torch.randn(3, 5))  # the same call, not quieted: torch.fx's own print
    assert "Call using an FX-traced Module" in capfd.readouterr().err

    def noisy():
        print("a warning worth seeing", file=sys.stderr)
        print("a result")
        return 7
    assert quiet(noisy)() == 7
    assert capfd.readouterr() == ("a result\n", "a warning worth seeing\n")
