"""The README's commands and the examples keep working."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def test_quickstart_trains_and_prints_the_plan():
    r = run("examples/quickstart.py")
    assert r.returncode == 0, r.stderr
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", r.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "# fxamp precision plan v2" in r.stdout
    assert "layer_norm is on autocast's fp32 list for cuda" in r.stdout


def test_demo_trains_with_gradscaler():
    r = run("-m", "fxamp", "demo", "--steps", "20")
    assert r.returncode == 0, r.stderr
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", r.stdout)
    assert m and float(m.group(2)) < float(m.group(1))


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    install = re.search(r"pip install (torch\S* torchvision\S* -e '\.\[[^\]]*\]')", readme)
    assert install and install.group(1) in ci


def test_numerics_example_fixes_what_autocast_breaks():
    r = run("examples/numerics.py")
    assert r.returncode == 0, r.stderr
    norm = re.search(r"fp32 (\S+)\s+autocast (\S+)\s+fxamp (\S+)", r.stdout.splitlines()[0])
    mse = re.search(r"fp32 (\S+)\s+autocast (\S+)\s+fxamp (\S+)", r.stdout.splitlines()[1])
    assert norm.group(2) == "nan" and abs(float(norm.group(3)) - float(norm.group(1))) < 1e-3
    assert float(mse.group(2)) == 0.0
    assert abs(float(mse.group(3)) - float(mse.group(1))) < 0.05 * float(mse.group(1))
    assert "norm_eps" in r.stdout


def test_audit_demo_finds_the_planted_mistakes():
    r = run("-m", "fxamp", "audit", "examples.audit_demo:build")
    assert r.returncode == 1, r.stderr  # an error finding (binary_cross_entropy)
    for code in ("norm-eps-underflow", "exp-without-max-shift", "explicit-cast",
                 "binary-cross-entropy", "dims-not-multiple-of-8"):
        assert code in r.stdout
    assert 'File "examples/audit_demo.py", line 13' in r.stdout


def test_calibration_example():
    r = run("examples/calibration.py")
    assert r.returncode == 0, r.stderr
    assert "without calibration: finite=False" in r.stdout
    assert "with calibration: finite=True" in r.stdout
    err = float(re.search(r"with calibration: finite=True max rel err=(\S+)", r.stdout).group(1))
    assert err < 1e-2 and "ranges    its output reaches" in r.stdout


def test_frontends_example():
    r = run("examples/frontends.py")
    assert r.returncode == 0, r.stderr
    assert "# frontend: fx+runtime" in r.stdout
    assert "# nested: shape=export gate=eager" in r.stdout
    err = float(re.search(r"max \|rewritten - fp32\|: (\S+)", r.stdout).group(1))
    assert err < 0.05  # two bf16 linears on unit-scale values
    names = [line.split()[0] for line in r.stdout.splitlines() if line and line[0] != "#"]
    pointers = re.findall(r"its nodes are the plan lines (\S+)/\*", r.stdout)
    assert len(pointers) == 3  # shape, gate and gate's lin: each names real plan lines
    for prefix in pointers:
        assert any(n.startswith(prefix + "/") for n in names), prefix
