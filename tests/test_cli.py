"""The fxamp command, run as a user runs it (a subprocess)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # every test runs the fxamp CLI in subprocesses


def _env():
    """The environment with PYTHONPATH made absolute (the tests may run fxamp elsewhere)."""
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + paths))


def fxamp(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fxamp", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=300, env=_env())


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


def test_file_factories_load_from_any_directory_relative_imports_too(tmp_path):
    pkg = tmp_path / "proj" / "models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "blocks.py").write_text("import torch.nn as nn\n\ndef block():\n"
                                   "    return nn.Sequential(nn.Linear(8, 4), nn.ReLU())\n")
    (pkg / "net.py").write_text("import torch\nfrom .blocks import block\n\ndef build():\n"
                                "    return block(), (torch.randn(2, 8),)\n")
    (tmp_path / "proj" / "helper.py").write_text("import torch.nn as nn\n\ndef mk():\n"
                                                 "    return nn.Linear(8, 3)\n")
    (tmp_path / "proj" / "flat.py").write_text(
        "import torch\n\ndef build():\n    from helper import mk  # imported lazily\n"
        "    return mk(), (torch.randn(2, 8),)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = fxamp("plan", "../proj/models/net.py:build", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("_0 ") and " nn.Linear " in line for line in r.stdout.splitlines())
    r = fxamp("plan", str(tmp_path / "proj" / "flat.py") + ":build", "--dtype", "bf16",
              cwd=elsewhere)
    assert r.returncode == 0 and "# policy: compute=bf16" in r.stdout, r.stderr
    # the README's example file, from a directory beside it
    out = elsewhere / "audit_demo.plan"
    r = fxamp("plan", os.path.relpath(ROOT / "examples" / "audit_demo.py", elsewhere) + ":build",
              "-o", str(out), cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert "binary_cross_entropy" in out.read_text()
    r = fxamp("plan", "../proj/missing.py:build", cwd=elsewhere)
    assert r.returncode == 2 and "no such file '../proj/missing.py'" in r.stderr
    assert "Traceback" not in r.stderr
    r = fxamp("plan", ".relative:build", cwd=elsewhere)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "file path" in r.stderr


def test_version():
    import fxamp as api
    r = fxamp("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"fxamp {api.__version__} (torch ")


def test_dtype_names_are_the_compute_dtypes_everywhere():
    import torch
    import fxamp as api
    r = fxamp("plan", "fxamp.demo:small_cnn", "--dtype", "fp32")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    says = r.stderr.strip().splitlines()[-1]
    assert "argument --dtype: compute dtype must be fp16 or bf16" in says
    valid = says.split("names: ")[1].split(")")[0].split(", ")
    assert "fp16" in valid and "bf16" in valid and "half" in valid
    assert not {"fp32", "float32", "float", "full", "f32"} & set(valid)
    assert "fp32:head.*" in says  # what to do instead
    # the same names and the same message from the policy grammar and the API
    with pytest.raises(api.PolicyError) as info:
        api.Policy.parse("compute=fp32")
    assert f"names: {', '.join(valid)})" in str(info.value)
    model, inputs = __import__("fxamp.demo", fromlist=["small_cnn"]).small_cnn()
    with pytest.raises(api.PolicyError, match="compute dtype must be fp16 or bf16"):
        api.amp_rewrite(model, inputs, api.RewriteConfig.make(dtype="fp32"))
    # fp32 stays valid where FP32 means something: overrides and the output dtype
    p = api.Policy.parse("output=fp32,fp32:fc")
    assert p.output_dtype is torch.float32 and p.overrides[0].dtype is torch.float32
    r = fxamp("demo", "--dtype", "fp32", "--steps", "1")
    assert r.returncode == 2 and "compute dtype must be fp16 or bf16" in r.stderr


def test_every_benchmark_script_parses_help_without_running():
    docs = ROOT / "docs" / "benchmarks.md"
    before = docs.read_bytes() if docs.exists() else None
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    assert len(scripts) >= 6
    runs = [subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for p in scripts]
    for script, run in zip(scripts, runs):
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, (script.name, err)
        assert out.startswith("usage: "), (script.name, out[:200])
    assert (docs.read_bytes() if docs.exists() else None) == before


def test_an_override_that_matches_nothing_exits_2_naming_the_closest():
    r = fxamp("plan", "fxamp.demo:small_cnn", "--policy", "fp32:conv9")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.startswith("fxamp plan: error: policy override 'fp32:conv9' matches no node")
    closest = r.stderr.split("closest node names / module paths: ")[1].splitlines()[0]
    assert {"conv1", "conv2"} <= set(closest.split(", "))
