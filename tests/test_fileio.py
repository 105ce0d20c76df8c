"""Atomic writes: the old file survives a killed process, a full disk, any exception."""
import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxamp
from fxamp import fileio
from fxamp.errors import OutputFileError
from fxamp.plan import NodePrecision, Plan

ROOT = Path(__file__).resolve().parents[1]
OLD = "# the committed plan\n"


def _big_plan(n=20000):
    return Plan(nodes={f"node_{i}": NodePrecision(torch.float16, "autocast", "a reason " * 4,
                                                  "nn.Linear", f"layers.{i}", torch.float16)
                       for i in range(n)}, header={"policy": "compute=fp16,target=cuda"})


def _leftovers(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.endswith(".tmp"))


def test_a_new_file_gets_the_umask_mode(tmp_path):
    umask = os.umask(0o027)
    try:
        fileio.atomic_write_text(str(tmp_path / "new.plan"), "x\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "new.plan").st_mode) == 0o640


def test_writes_replace_the_file_and_leave_no_temporary_file(tmp_path):
    path = tmp_path / "model.plan"
    path.write_text(OLD)
    os.chmod(path, 0o640)
    fileio.atomic_write_text(str(path), "new\u00e9\n")
    assert path.read_text(encoding="utf-8") == "new\u00e9\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # the file keeps its mode
    assert _leftovers(tmp_path) == []


def test_a_full_disk_half_way_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.plan"
    path.write_text(OLD)
    real_write = os.write
    calls = []

    def full_disk(fd, data):
        if calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        calls.append(len(data))
        return real_write(fd, bytes(data[:len(data) // 2]))  # a short write, then ENOSPC

    monkeypatch.setattr(fileio.os, "write", full_disk)
    with pytest.raises(OutputFileError, match="No space left on device") as err:
        _big_plan(2000).save(str(path))
    assert err.value.errno == errno.ENOSPC and "free disk space" in str(err.value)
    assert isinstance(err.value, fxamp.FxampError) and isinstance(err.value, OSError)
    monkeypatch.undo()
    assert path.read_text() == OLD
    assert _leftovers(tmp_path) == []


def test_an_exception_half_way_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.plan"
    path.write_text(OLD)
    real_write = os.write

    def interrupted(fd, data):
        real_write(fd, bytes(data[:len(data) // 2]))
        raise KeyboardInterrupt

    monkeypatch.setattr(fileio.os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fileio.atomic_write_text(str(path), "x" * 100_000)
    monkeypatch.undo()
    assert path.read_text() == OLD and _leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "model.plan"
    path.write_text(OLD)
    child = textwrap.dedent(f"""
        import os, sys, time
        import torch
        from fxamp import fileio
        from fxamp.plan import NodePrecision, Plan
        real_write = os.write
        def slow(fd, data):  # write half, tell the parent, wait to be killed
            real_write(fd, bytes(data[:len(data) // 2]))
            os.fsync(fd)
            sys.stdout.write("half\\n"); sys.stdout.flush()
            time.sleep(60)
        fileio.os.write = slow
        plan = Plan(nodes={{f"n{{i}}": NodePrecision(torch.float16, "autocast", "why " * 8)
                           for i in range(20000)}})
        plan.save({str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert proc.stdout.readline() == b"half\n"
        partial = _leftovers(tmp_path)
        assert len(partial) == 1 and (tmp_path / partial[0]).stat().st_size > 100_000
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert path.read_text() == OLD  # the killed writer only left its temporary file


def test_missing_directories_are_created(tmp_path):
    path = tmp_path / "a" / "b" / "model.plan"
    plan = _big_plan(3)
    plan.save(str(path))
    assert Plan.load(str(path)) == plan


def test_a_path_through_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputFileError, match=r"cannot write .*file/model\.plan: .*/file is "
                       r"a file, not a directory\n  what to do: choose another path"):
        fileio.atomic_write_text(str(tmp_path / "file" / "model.plan"), "y")


def test_permission_denied_is_a_clear_error(tmp_path, monkeypatch):
    def denied(*args, **kwargs):  # what a directory without write permission gives
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(fileio, "_open_temp", denied)
    with pytest.raises(OutputFileError, match="Permission denied\n  what to do: choose a "
                       "writable location"):
        fileio.atomic_write_text(str(tmp_path / "model.plan"), "y")


def test_a_symlink_is_written_through(tmp_path):
    real = tmp_path / "real.plan"
    real.write_text(OLD)
    link = tmp_path / "link.plan"
    link.symlink_to(real)
    fileio.atomic_write_text(str(link), "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"


def test_a_failing_directory_writer_leaves_the_old_files(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with fileio.atomic_directory(str(path)) as tmpdir:
            Path(tmpdir, "model.onnx").write_bytes(b"new, half")
            raise RuntimeError("the exporter failed")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    with fileio.atomic_directory(str(path)) as tmpdir:
        Path(tmpdir, "model.onnx").write_bytes(b"new")
        Path(tmpdir, "model.onnx.data").write_bytes(b"weights")
    assert path.read_bytes() == b"new" and (tmp_path / "model.onnx.data").read_bytes() == \
        b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
