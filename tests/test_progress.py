"""Progress bars (fxamp.progress, tqdm): drawn on a terminal, never in pipes or logs.

The terminal is a real pseudo-terminal (os.openpty) as the stderr of a fresh process that
runs fxamp's long jobs for real: calibration, the tolerance search, the export front end's
torch.export and the ONNX export.
"""
import fcntl
import io
import os
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from fxamp import progress

ROOT = Path(__file__).resolve().parents[1]

JOBS = r"""
import torch, torch.nn as nn, fxamp
from fxamp.export import export_onnx
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
x = torch.randn(4, 8)
batches = [(torch.randn(4, 8),) for _ in range(3)]
fxamp.search(model, (x,), batches,
             fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"), rtol=1e-9)
gm = fxamp.amp_rewrite(model, (x,),
                       fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu",
                                                frontend="export",
                                                calibration_data=batches))
export_onnx(gm, (x,), sys.argv[1])
print("done")
"""
BARS = ("fxamp: calibration", "fxamp: search", "fxamp: scoring nodes",
        "fxamp: torch.export of Sequential", "fxamp: ONNX export to m.onnx")


def _run(tmp_path, stderr_tty: bool) -> str:
    """Run JOBS in a new process; return what it wrote to stderr (a pty or a pipe)."""
    script = tmp_path / "jobs.py"
    script.write_text("import sys\n" + JOBS)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop("FXAMP_PROGRESS", None)
    args = [sys.executable, str(script), str(tmp_path / "m.onnx")]
    if not stderr_tty:
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0 and "done" in r.stdout, r.stderr
        return r.stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the other side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=slave, env=env,
                              timeout=300)
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    assert proc.returncode == 0 and b"done" in proc.stdout, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_bars_on_a_terminal_and_none_in_a_pipe(tmp_path):
    on_tty = _run(tmp_path, True)
    for bar in BARS:
        assert bar in on_tty, (bar, on_tty[-3000:])
    assert "eval" in on_tty and "fp32 nodes, error" in on_tty  # the search counts evaluations
    piped = _run(tmp_path, False)
    assert "fxamp: " not in piped and "\r" not in piped, piped[-2000:]


def test_track_draws_on_a_tty_file_only():
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert progress.shown(tty)
            assert list(progress.track(range(5), "batches", file=tty)) == list(range(5))
            tty.flush()
        drawn = os.read(master, 65536).decode()
        assert "fxamp: batches" in drawn and "/5 [" in drawn
    finally:
        os.close(slave)
        os.close(master)
    buf = io.StringIO()  # a file, a log, a pipe: no isatty -> nothing
    assert not progress.shown(buf)
    assert list(progress.track(range(5), "batches", file=buf)) == list(range(5))
    assert buf.getvalue() == ""


@pytest.mark.parametrize("value", ["0", "off"])
def test_env_turns_bars_off(monkeypatch, value):
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert progress.shown(tty)
            monkeypatch.setenv("FXAMP_PROGRESS", value)
            assert not progress.shown(tty)
    finally:
        os.close(slave)
        os.close(master)


def test_advance_without_a_bar_is_a_no_op():
    progress.advance(postfix="nothing open")  # no bar open in this thread: nothing happens
    with progress.progress("work", total=3, file=io.StringIO()) as bar:
        progress.advance(2)
        assert bar.n == 2
