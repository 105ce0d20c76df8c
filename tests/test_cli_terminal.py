"""The fxamp command in any process state, run as a user runs it (a subprocess): a full or
unusable temporary directory (``TMPDIR``)."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # every test runs the fxamp CLI in subprocesses

#: a model whose factory says when it runs, then waits to be killed (MARK: the file it
#: makes); and one whose ONNX file (about 0.5 MB) does not fit in a 64 KiB tmpfs
FACTORIES = """
    import os, time
    import torch
    import torch.nn as nn

    def waits():
        open(os.environ["MARK"], "w").close()
        time.sleep(120)
        return nn.Linear(8, 4), (torch.randn(2, 8),)

    def big():
        return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)), \\
            (torch.randn(2, 512),)

    def small():
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), (torch.randn(2, 8),)
"""


def _env(**extra: str) -> dict:
    """The environment with PYTHONPATH made absolute, plus ``extra``."""
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + paths), **extra)


def _fxamp(*args: str, cwd: Path, encoding: str = "utf-8", **extra: str
           ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxamp", *args], capture_output=True,
                          encoding=encoding, cwd=cwd, timeout=300, env=_env(**extra))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder with ``models.py`` (FACTORIES) and an empty ``tmpdir/`` to be TMPDIR."""
    (tmp_path / "models.py").write_text(textwrap.dedent(FACTORIES))
    (tmp_path / "tmpdir").mkdir()
    return tmp_path


# ------------------------------------------------------------------ TMPDIR
def _in_a_mount_namespace(script: str, *command: str, cwd: Path, **extra: str
                          ) -> subprocess.CompletedProcess:
    """``command`` run by ``sh -c script`` in a new user and mount namespace (where it may
    mount a small or read-only tmpfs without privileges); skipped where the system allows
    no such namespace."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("this system cannot make a user and mount namespace (unshare -rm), "
                    "which the test needs to give fxamp a full or read-only TMPDIR")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *command],
                          capture_output=True, text=True, cwd=cwd, timeout=300,
                          env=_env(**extra))


def test_a_full_tmpdir_is_named_in_the_error(work: Path) -> None:
    small = work / "small-tmp"
    small.mkdir()
    r = _in_a_mount_namespace('mount -t tmpfs -o size=64k tmpfs "$TMPDIR" && exec "$@"',
                              sys.executable, "-m", "fxamp", "export", "models.py:big",
                              "--target", "cpu", "-o", "model.onnx", cwd=work,
                              TMPDIR=str(small))
    assert r.returncode == 2, r.stderr
    assert "No space left on device" in r.stderr, r.stderr
    assert f"the temporary directory is full: TMPDIR={small}" in r.stderr, r.stderr
    assert "set TMPDIR to a writable directory with room" in r.stderr
    assert "Traceback" not in r.stderr and not (work / "model.onnx").exists()


def test_an_unusable_tmpdir_is_named_in_the_error(work: Path) -> None:
    # TMPDIR and every directory Python's tempfile falls back to are read-only
    r = _in_a_mount_namespace(
        "mount -t tmpfs -o ro,size=16k tmpfs /tmp && mount -t tmpfs -o ro,size=16k tmpfs "
        '/var/tmp && cd /tmp && exec "$@"', sys.executable, "-m", "fxamp", "export",
        "fxamp.demo:small_cnn", "--target", "cpu", "-o", "/dev/null", cwd=work,
        TMPDIR="/tmp/scratch")
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if "rewriting" not in line]
    assert lines[0].startswith("fxamp export: error: cannot make a temporary folder "
                               "(TMPDIR=/tmp/scratch): "), r.stderr
    assert lines[1:] == ["  what to do: set TMPDIR to a writable directory with room "
                         "(TMPDIR=/path/with/space fxamp ...) and run again; fxamp stages "
                         "its outputs there until the command succeeds"], r.stderr
