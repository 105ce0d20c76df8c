"""The fxamp command, run as a user runs it (a subprocess)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fxamp(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fxamp", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=300)


def test_plan_prints_the_plan():
    r = fxamp("plan", "fxamp.demo:small_cnn", "--dtype", "bf16", "--target", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# fxamp precision plan v2")
    assert "# policy: compute=bf16,target=cpu" in r.stdout
    assert any(l.startswith("conv1 ") and " bf16 " in l for l in r.stdout.splitlines())


def test_plan_to_file_then_diff(tmp_path):
    a, b = tmp_path / "a.plan", tmp_path / "b.plan"
    assert fxamp("plan", "fxamp.demo:small_cnn", "-o", str(a)).returncode == 0
    assert fxamp("plan", "fxamp.demo:small_cnn", "--policy", "fp32:conv2", "-o",
                 str(b)).returncode == 0
    same = fxamp("diff", str(a), str(a))
    assert (same.returncode, same.stdout) == (0, "")
    differ = fxamp("diff", str(a), str(b))
    assert differ.returncode == 1
    # conv2 moves to fp32, and bn2 / relu / mean (on no list) follow it
    assert "~ conv2" in differ.stdout and "~ bn2" in differ.stdout
    assert differ.stdout.splitlines()[-1] == "4 nodes changed precision: 4 FP16\u2192FP32"


def test_diff_of_missing_or_malformed_file_exits_2(tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text("hello\n")
    r = fxamp("diff", str(bad), str(tmp_path / "missing.plan"))
    assert r.returncode == 2 and "line 1" in r.stderr and "Traceback" not in r.stderr
    r = fxamp("diff", str(tmp_path / "missing.plan"), str(bad))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_plan_with_input_shape_for_a_factory_that_returns_only_a_model(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\n"
        "def mlp():\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))\n")
    r = fxamp("plan", "mymodels:mlp", "--input-shape", "2,8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "linear is on autocast's lower-precision list for cuda" in r.stdout
    r = fxamp("plan", "mymodels:mlp", cwd=tmp_path)
    assert r.returncode == 2 and "--input-shape" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("spec", ["nonexistent_module_xyz:f", "fxamp.demo:nothing", "nocolon"])
def test_bad_factory_specs_exit_2_with_one_clear_line(spec):
    r = fxamp("plan", spec)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error" in r.stderr


def test_diff_markdown_is_a_table(tmp_path):
    a, b = tmp_path / "a.plan", tmp_path / "b.plan"
    fxamp("plan", "fxamp.demo:small_cnn", "-o", str(a))
    fxamp("plan", "fxamp.demo:small_cnn", "--policy", "fp32:fc", "-o", str(b))
    r = fxamp("diff", str(a), str(b), "--format", "markdown")
    assert r.returncode == 1
    assert "| ~ | `fc` | `nn.Linear` | fp16 | fp32 | autocast \u2192 user |" in r.stdout


def test_check_passes_fails_and_updates(tmp_path):
    plan = tmp_path / "model.plan"
    r = fxamp("check", "fxamp.demo:small_cnn", "--plan", str(plan))
    assert r.returncode == 2 and "--update" in r.stderr
    assert fxamp("check", "fxamp.demo:small_cnn", "--plan", str(plan),
                 "--update").returncode == 0
    assert fxamp("check", "fxamp.demo:small_cnn", "--plan", str(plan)).returncode == 0
    r = fxamp("check", "fxamp.demo:small_cnn", "--plan", str(plan), "--policy", "fp32:fc")
    assert r.returncode == 1 and "~ fc" in r.stdout and "--update" in r.stderr


def test_show_writes_html(tmp_path):
    out = tmp_path / "graph.html"
    r = fxamp("show", "fxamp.demo:small_cnn", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("<!DOCTYPE html>")


def test_audit_min_severity_hides_info_lines_but_counts_them():
    r = fxamp("audit", "fxamp.demo:small_cnn", "--min-severity", "warning")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("5 findings: 5 info") and "5 below warning not shown" in lines[-1]
    assert len(lines) == 1


def test_unreadable_plans_exit_2_never_a_traceback(tmp_path):
    import fxamp as api
    from fxamp.demo import small_cnn
    good = tmp_path / "good.plan"
    text = api.plan_of(api.amp_rewrite(*small_cnn())).to_text()
    good.write_text(text)
    (tmp_path / "binary.plan").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    (tmp_path / "latin1.plan").write_bytes(text.replace("model input", "mod\u00e8le")
                                           .encode("latin-1"))
    (tmp_path / "cut.plan").write_text("".join(text.splitlines(keepends=True)[:8]))
    (tmp_path / "header_only.plan").write_text("".join(text.splitlines(keepends=True)[:3]))
    (tmp_path / "dir.plan").mkdir()
    for name, says in [("binary.plan", "not UTF-8"), ("latin1.plan", "line 7: byte 0xe8"),
                       ("cut.plan", "line 8: the plan ends without its end marker"),
                       ("header_only.plan", "line 3: the plan ends without"),
                       ("dir.plan", "cannot read")]:
        r = fxamp("diff", str(good), str(tmp_path / name))
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = fxamp("check", "fxamp.demo:small_cnn", "--plan", str(tmp_path / "cut.plan"))
    assert r.returncode == 2 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_check_reads_a_version_1_plan(tmp_path):
    plan = tmp_path / "model.plan"
    assert fxamp("check", "fxamp.demo:small_cnn", "--plan", str(plan), "--update").returncode == 0
    v2 = plan.read_text()
    plan.write_text(v2.replace("plan v2", "plan v1").replace(v2.splitlines()[-1] + "\n", ""))
    r = fxamp("check", "fxamp.demo:small_cnn", "--plan", str(plan))
    assert r.returncode == 0 and "cannot be detected" in r.stderr, r.stderr


def test_outputs_into_missing_directories_and_unwritable_places(tmp_path):
    out = tmp_path / "new" / "dir" / "graph.dot"
    r = fxamp("show", "fxamp.demo:small_cnn", "-o", str(out))
    assert r.returncode == 0 and out.read_text().startswith("digraph"), r.stderr
    (tmp_path / "afile").write_text("x")
    r = fxamp("plan", "fxamp.demo:small_cnn", "-o", str(tmp_path / "afile" / "model.plan"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "afile is a file, not a directory" in r.stderr and "what to do" in r.stderr
