"""What the fxamp command refuses rather than ignores or overrides without a word (exit 2,
one line naming the flag, the values and what to do, before any work): a flag that a
``--policy`` item contradicts (its own or a recipe's), more ``--input-shape`` than the
model's forward takes, a flag given twice, a flag the command does not use with the others
given; and a write past the per-file size limit (``ulimit -f``) names that limit, not
TMPDIR. The command runs in-process (``main``) except for the size limit (a subprocess)."""
import itertools
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxamp.cli import main

ROOT = Path(__file__).resolve().parents[1]
_names = itertools.count()

FACTORIES = """
    import torch
    import torch.nn as nn

    def mlp():
        return nn.Sequential(nn.Linear(8, 4), nn.ReLU())

    def mlp_with_inputs():
        return nn.Sequential(nn.Linear(8, 4), nn.ReLU()), (torch.randn(2, 8),)

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, mask=None):
            return self.fc(x) if mask is None else self.fc(x) * mask

    def masked():
        return Masked()

    class Star(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, *xs):
            return sum(self.fc(x) for x in xs)

    def star():
        return Star()
"""


def run(*argv):
    """The exit status of ``fxamp *argv`` (its output goes to capsys)."""
    try:
        return main(list(argv))
    except SystemExit as stop:  # argparse's own errors
        return stop.code


@pytest.fixture
def m(tmp_path, monkeypatch):
    """A module of FACTORIES in a fresh current directory: its name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"cli_conflict_models_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def _error(capsys, command):
    """The one stderr line of a refused command (no traceback, nothing on stdout)."""
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"fxamp {command}: error: "), err
    assert "Traceback" not in err and out == "", (out, err)
    return lines[0]


# ------------------------------------------------------------------ flags against the policy
@pytest.mark.parametrize("argv, says", [
    (["--target", "cuda", "--policy", "cpu-bf16"],
     "--target cuda conflicts with the policy's target=cpu (--policy cpu-bf16, whose recipe "
     "cpu-bf16 is compute=bf16,target=cpu); what to do: give the target once: leave out "
     "--target to use target=cpu, or for cuda write --policy compute=bf16 --target cuda"),
    (["--target", "cuda", "--policy", "compute=bf16,target=cpu"],
     "--target cuda conflicts with the policy's target=cpu (--policy compute=bf16,target=cpu)"),
    (["--target", "cpu", "--policy", "tensorrt,fp32:fc"],
     "--target cpu conflicts with the policy's target=tensorrt (--policy tensorrt,fp32:fc, "
     "whose recipe tensorrt is compute=fp16,target=tensorrt); what to do: give the target "
     "once: leave out --target to use target=tensorrt, or for cpu write --policy "
     "compute=fp16,fp32:fc --target cpu"),
    (["--dtype", "fp16", "--policy", "cpu-bf16"],
     "--dtype fp16 conflicts with the policy's compute=bf16 (--policy cpu-bf16, whose recipe "
     "cpu-bf16 is compute=bf16,target=cpu); what to do: give the compute once: leave out "
     "--dtype to use compute=bf16, or for fp16 write --policy target=cpu --dtype fp16"),
    (["--dtype", "bf16", "--policy", "compute=fp16"],
     "--dtype bf16 conflicts with the policy's compute=fp16 (--policy compute=fp16); what to "
     "do: give the compute once: leave out --dtype to use compute=fp16, or for bf16 write "
     "--dtype bf16 without --policy"),
])
@pytest.mark.parametrize("command", ["plan", "audit"])
def test_a_flag_the_policy_contradicts_is_refused(m, capsys, command, argv, says):
    assert run(command, f"{m}:mlp_with_inputs", *argv) == 2
    assert says in _error(capsys, command)


def test_the_conflict_is_refused_by_every_model_command(m, capsys, tmp_path):
    conflict = ["--target", "cuda", "--policy", "cpu-bf16"]
    for command, extra in [("check", ["--plan", "x.plan"]), ("show", ["-o", "g.html"]),
                           ("show", ["-o", "g.json", "--format", "model-explorer"]),
                           ("export", ["-o", "m.onnx"])]:
        assert run(command, f"{m}:mlp_with_inputs", *conflict, *extra) == 2, command
        err = capsys.readouterr().err
        assert "--target cuda conflicts with the policy's target=cpu" in err, err
    assert not any(p.suffix in (".plan", ".html", ".json", ".onnx")
                   for p in tmp_path.iterdir())  # refused before any work


@pytest.mark.parametrize("argv", [
    ["--target", "cpu", "--policy", "cpu-bf16"],
    ["--dtype", "bf16", "--target", "cpu", "--policy", "cpu-bf16,fp32:0"],
    ["--dtype", "bfloat16", "--target", "cpu", "--policy", "compute=bf16"],
    ["--policy", "cpu-bf16"],  # the policy alone: its target, not --target's default cuda
    ["--target", "cpu", "--policy", "compute=bf16,target=cuda,target=cpu"],  # the last wins
])
def test_a_flag_that_agrees_with_the_policy_is_fine(m, capsys, argv):
    assert run("plan", f"{m}:mlp_with_inputs", *argv) == 0, capsys.readouterr().err
    assert "# policy: compute=bf16,target=cpu" in capsys.readouterr().out


# ------------------------------------------------------------------ --input-shape
def test_more_input_shapes_than_the_forward_takes_are_refused(m, capsys):
    assert run("plan", f"{m}:mlp", "--input-shape", "2,8", "--input-shape", "3,8") == 2
    assert _error(capsys, "plan") == (
        f"fxamp plan: error: 2 --input-shape given (2,8 3,8), but the forward of {m}:mlp "
        "(Sequential) takes 1 input (input), so the last one would be ignored; what to do: "
        "give one --input-shape per input of forward, in its order (at most 1)")
    assert run("audit", f"{m}:masked", *["--input-shape", "2,8"] * 3) == 2
    assert ("3 --input-shape given (2,8 2,8 2,8), but the forward of "
            f"{m}:masked (Masked) takes 1 to 2 inputs (x, mask=)") in _error(capsys, "audit")
    # a factory's own inputs are replaced by --input-shape: the count is checked the same
    assert run("check", f"{m}:mlp_with_inputs", "--plan", "x.plan", "--input-shape", "2,8",
               "--input-shape", "2,8") == 2
    assert "(Sequential) takes 1 input (input)" in _error(capsys, "check")


@pytest.mark.parametrize("command, extra", [("export", ["-o", "m.onnx"]),
                                            ("show", ["-o", "g.json", "--format",
                                                      "model-explorer"])])
def test_commands_on_real_inputs_refuse_extra_input_shapes_too(m, capsys, tmp_path, command,
                                                               extra):
    assert run(command, f"{m}:mlp", "--input-shape", "2,8", "--input-shape", "3,8",
               *extra) == 2
    err = capsys.readouterr().err
    assert "2 --input-shape given (2,8 3,8)" in err and "Traceback" not in err, err
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "g.json").exists()


def test_as_many_input_shapes_as_the_forward_takes_are_fine(m, capsys):
    assert run("plan", f"{m}:masked", "--input-shape", "2,8") == 0, capsys.readouterr().err
    assert run("plan", f"{m}:masked", "--input-shape", "2,8", "--input-shape", "2,8") == 0
    assert run("plan", f"{m}:star", *["--input-shape", "2,8"] * 3) == 0  # *args: any number
    capsys.readouterr()


# ------------------------------------------------------------------ repeated or unused flags
@pytest.mark.parametrize("argv, says", [
    (["plan", "{m}:mlp_with_inputs", "--policy", "fp32:0", "--policy", "fp32:1"],
     "--policy given twice (fp32:0, fp32:1); it takes one value, and all but the last would "
     "be ignored; what to do: give it once (several policy items go comma-separated into one "
     "--policy, e.g. --policy cpu-bf16,fp32:head.*)"),
    (["plan", "{m}:mlp_with_inputs", "--dtype", "fp16", "--dtype", "bf16"],
     "--dtype given twice (fp16, bf16)"),
    (["plan", "{m}:mlp_with_inputs", "--target", "cpu", "--target", "cpu", "--target", "cuda"],
     "--target given 3 times (cpu, cpu, cuda)"),
    (["plan", "{m}:mlp_with_inputs", "-o", "a.plan", "--output", "b.plan"],
     "-o/--output given twice (a.plan, b.plan)"),
    (["audit", "{m}:mlp_with_inputs", "--frontend", "fx", "--frontend", "export"],
     "--frontend given twice (fx, export)"),
    (["diff", "a.plan", "b.plan", "--format", "text", "--format", "markdown"],
     "--format given twice (text, markdown)"),
    (["demo", "--steps", "2", "--steps", "3"], "--steps given twice (2, 3)"),
    (["export", "{m}:mlp_with_inputs", "-o", "m.onnx", "--backend", "onnxruntime"],
     "--backend onnxruntime would be ignored: the backend runs the exported model only for "
     "--report and --model-explorer; what to do: add --report or --model-explorer FILE, or "
     "leave out --backend"),
    (["check", "{m}:mlp_with_inputs", "--plan", "x.plan", "--update", "--format", "markdown"],
     "--format markdown would be ignored: with --update the plan file is rewritten and "
     "nothing is compared or printed; what to do: leave out --format, or leave out --update "
     "to compare and print the differences in that format"),
])
def test_a_flag_that_would_be_ignored_is_refused(m, capsys, tmp_path, argv, says):
    argv = [a.format(m=m) for a in argv]
    assert run(*argv) == 2
    assert _error(capsys, argv[0]).startswith(f"fxamp {argv[0]}: error: {says}")
    assert not any(p.suffix in (".plan", ".onnx") for p in tmp_path.iterdir())


def test_flags_used_together_are_fine(m, capsys, tmp_path):
    plan = tmp_path / "x.plan"
    assert run("check", f"{m}:mlp_with_inputs", "--plan", str(plan), "--update") == 0
    assert run("check", f"{m}:mlp_with_inputs", "--plan", str(plan), "--format",
               "markdown") == 0
    capsys.readouterr()
    assert run("export", f"{m}:mlp_with_inputs", "-o", "m.onnx", "--report", "r.md",
               "--backend", "onnxruntime", "-o", "n.onnx") == 2  # (-o twice, --backend used)
    assert "-o given twice (m.onnx, n.onnx)" in _error(capsys, "export")


# ------------------------------------------------------------------ ulimit -f
@pytest.mark.slow  # subprocesses
def test_a_write_past_the_file_size_limit_names_the_limit_not_tmpdir(tmp_path):
    """Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE fails with EFBIG ("File too
    large"): the advice names the limit in bytes and raising it, never TMPDIR (the staged
    export once said to set TMPDIR, which cannot help)."""
    (tmp_path / "fsize_models.py").write_text(textwrap.dedent(FACTORIES))
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

    def limited():  # (the ONNX file of mlp takes some 7 KB, the plan of small_cnn 1.3 KB)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                           os.environ.get("PYTHONPATH", "")]))

    def fxamp(*argv):
        return subprocess.run([sys.executable, "-m", "fxamp", *argv], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=300,
                              preexec_fn=limited)

    limit = ("  what to do: the file is larger than this process may write: its per-file "
             "size limit (RLIMIT_FSIZE) is 1024 bytes (ulimit -f 1, in 1024-byte blocks)")
    advice = ("; setting TMPDIR or writing elsewhere does not help. Raise the limit in the "
              "shell that runs fxamp (ulimit -f unlimited, or a size above the file's) and "
              "run again; the old file is unchanged")
    out = tmp_path / "out.onnx"
    r = fxamp("export", "fsize_models.py:mlp", "--input-shape", "2,8", "-o", str(out))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and not out.exists(), r.stderr
    lines = [line for line in r.stderr.splitlines() if not line.endswith(" ...")]
    assert lines[0].startswith(f"fxamp export: error: cannot write {out} (staged as "), r.stderr
    assert lines[0].endswith("): File too large") and len(lines) == 2, r.stderr
    assert lines[1].startswith(limit) and lines[1].endswith(advice), r.stderr
    r = fxamp("plan", "fxamp.demo:small_cnn", "-o", "out.plan")
    assert r.returncode == 2 and not (tmp_path / "out.plan").exists(), r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == "fxamp plan: error: cannot write out.plan: File too large", r.stderr
    assert lines[1].startswith(limit) and lines[1].endswith(advice) and len(lines) == 2


def test_file_too_large_without_a_size_limit_names_the_file_system(tmp_path, monkeypatch):
    import errno

    from fxamp import fileio

    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,
                                                              resource.RLIM_INFINITY))
    err = fileio.output_error(str(tmp_path / "big.onnx"), OSError(errno.EFBIG, "File too "
                                                                           "large"))
    assert str(err).startswith(f"cannot write {tmp_path / 'big.onnx'}: File too large\n"
                               f"  what to do: the file system of {tmp_path} cannot hold a "
                               "file this large"), str(err)
    assert "RLIMIT_FSIZE" not in str(err) and err.errno == errno.EFBIG
