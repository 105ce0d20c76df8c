"""The README's commands and the examples keep working."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.mark.slow
def test_quickstart_trains_and_prints_the_plan():
    """On CPU, fp16: the GradScaler really scales (a bare GradScaler() would warn and
    disable itself there), the loss falls, no warning is printed."""
    r = run("-W", "error::UserWarning", "examples/quickstart.py", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "device cpu, fp16, GradScaler enabled: True" in r.stdout
    scales = [float(m) for m in re.findall(r"scale (\d+)", r.stdout)]
    assert scales and min(scales) > 1  # scaled: 65536, not the disabled scaler's 1.0
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", r.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "# fxamp precision plan v2" in r.stdout and "target=cpu" in r.stdout
    assert "linear is on autocast's lower-precision list for cpu" in r.stdout


def _quickstart():
    import importlib.util
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only as a script
    return module


def test_quickstart_scaler_per_device_and_dtype():
    import torch
    qs = _quickstart()
    assert qs.make_scaler(torch.device("cpu"), torch.float16).is_enabled()
    assert not qs.make_scaler(torch.device("cpu"), torch.bfloat16).is_enabled()
    if torch.cuda.is_available():
        assert qs.make_scaler(torch.device("cuda"), torch.float16).is_enabled()


def test_quickstart_rewrites_on_meta():
    """The quickstart's model on the meta device (no data, no compute): rewritten with the
    lists of the target, its gradients FP32 meta tensors. (GradScaler itself reads values
    with .item(), which meta tensors do not have.)"""
    import torch
    import torch.nn.functional as F
    qs = _quickstart()
    meta = torch.device("meta")
    model, gm = qs.build(meta, torch.float16, target="cuda")
    x, y = torch.randn(32, 64, device=meta), torch.randint(0, 10, (32,), device=meta)
    F.cross_entropy(gm(x), y).backward()
    assert all(p.device.type == "meta" and p.grad.dtype == torch.float32
               for p in model.parameters())
    import fxamp
    plan = fxamp.plan_of(gm)
    assert plan.header["policy"] == "compute=fp16,target=cuda"
    assert [p.dtype for p in plan.nodes.values() if p.module in ("0", "2", "5")] == [
        torch.float16, torch.float32, torch.float16]  # linear fp16, layer_norm fp32 (cuda)


@pytest.mark.slow
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


@pytest.mark.slow
def test_numerics_example_fixes_what_autocast_breaks():
    r = run("examples/numerics.py")
    assert r.returncode == 0, r.stderr
    norm = re.search(r"fp32 (\S+)\s+autocast (\S+)\s+fxamp (\S+)", r.stdout.splitlines()[0])
    mse = re.search(r"fp32 (\S+)\s+autocast (\S+)\s+fxamp (\S+)", r.stdout.splitlines()[1])
    assert norm.group(2) == "nan" and abs(float(norm.group(3)) - float(norm.group(1))) < 1e-3
    assert float(mse.group(2)) == 0.0
    assert abs(float(mse.group(3)) - float(mse.group(1))) < 0.05 * float(mse.group(1))
    assert "norm_eps" in r.stdout


@pytest.mark.slow
def test_audit_demo_finds_the_planted_mistakes():
    r = run("-m", "fxamp", "audit", "examples.audit_demo:build")
    assert r.returncode == 1, r.stderr  # an error finding (binary_cross_entropy)
    for code in ("norm-eps-underflow", "exp-without-max-shift", "explicit-cast",
                 "binary-cross-entropy", "dims-not-multiple-of-8"):
        assert code in r.stdout
    assert 'File "examples/audit_demo.py", line 13' in r.stdout


@pytest.mark.slow
def test_calibration_example():
    r = run("examples/calibration.py")
    assert r.returncode == 0, r.stderr
    assert "without calibration: finite=False" in r.stdout
    assert "with calibration: finite=True" in r.stdout
    err = float(re.search(r"with calibration: finite=True max rel err=(\S+)", r.stdout).group(1))
    assert err < 1e-2 and "ranges    its output reaches" in r.stdout


@pytest.mark.slow
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
