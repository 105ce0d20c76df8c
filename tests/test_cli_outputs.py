"""Where the commands write: a regular file atomically, a device or FIFO straight into it
(never replaced by a regular file), and nothing before the command has succeeded."""
import os
import stat
import threading

import pytest

from fxamp import fileio
from fxamp.cli import main

MODEL = "fxamp.demo:small_cnn"


def run(*argv):
    try:
        return main(list(argv))
    except SystemExit as stop:
        return stop.code


class Reader(threading.Thread):
    """Reads a FIFO to its end, as the other side of a pipe does."""

    def __init__(self, path):
        super().__init__(daemon=True)
        self.path, self.data = path, b""

    def run(self):
        with open(self.path, "rb") as fh:
            self.data = fh.read()


def _fifo(tmp_path, name):
    path = tmp_path / name
    os.mkfifo(path)
    reader = Reader(path)
    reader.start()
    return str(path), reader


def _commands(out, tmp_path):
    return {
        "plan": ["plan", MODEL, "-o", out],
        "show": ["show", MODEL, "-o", out, "--format", "dot"],
        "check --update": ["check", MODEL, "--plan", out, "--update"],
    }


def _expected(command, data):
    if command == "show":
        assert data.startswith(b"digraph")
    else:
        assert data.startswith(b"# fxamp precision plan v2") and b"# end of plan" in data


@pytest.mark.parametrize("command", ["plan", "show", "check --update"])
def test_a_fifo_gets_the_output_and_stays_a_fifo(tmp_path, capsys, command):
    path, reader = _fifo(tmp_path, "out")
    assert run(*_commands(path, tmp_path)[command]) == 0, capsys.readouterr().err
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert stat.S_ISFIFO(os.stat(path).st_mode)
    _expected(command, reader.data)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary file left


def _char_device(tmp_path):
    """A private null device (as root), so that a failure cannot touch /dev/null."""
    path = tmp_path / "null"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node needs root")
    return str(path)


@pytest.mark.parametrize("command", ["plan", "show", "check --update"])
def test_a_character_device_stays_one(tmp_path, capsys, command):
    for device in (_char_device(tmp_path), os.devnull):
        assert stat.S_ISCHR(os.stat(device).st_mode)
        assert run(*_commands(device, tmp_path)[command]) == 0, capsys.readouterr().err
        assert stat.S_ISCHR(os.stat(device).st_mode), f"{device} was replaced"


def test_dev_stdout_is_the_command_s_output(capfd):
    assert fileio.writes_in_place("/dev/stdout")
    assert run("plan", MODEL, "-o", "/dev/stdout") == 0
    out, err = capfd.readouterr()
    assert out.startswith("# fxamp precision plan v2"), err
    assert "\nwrote /dev/stdout (11 nodes)\n" in out


def test_a_regular_file_is_still_replaced_atomically(tmp_path, capsys):
    path = tmp_path / "model.plan"
    path.write_text("old\n")
    inode = os.stat(path).st_ino
    assert not fileio.writes_in_place(str(path))
    assert run("plan", MODEL, "-o", str(path)) == 0
    assert path.read_text().startswith("# fxamp precision plan v2")
    assert os.stat(path).st_ino != inode  # a new file moved over the old one


@pytest.fixture(scope="module")
def onnx_available():
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")


def test_export_into_a_fifo_and_a_device(tmp_path, capsys, onnx_available):
    import onnx
    path, reader = _fifo(tmp_path, "model.onnx")
    device = _char_device(tmp_path)
    assert run("export", MODEL, "-o", path, "--report", device) == 0, capsys.readouterr().err
    reader.join(timeout=120)
    assert stat.S_ISFIFO(os.stat(path).st_mode) and stat.S_ISCHR(os.stat(device).st_mode)
    model = onnx.load_from_string(reader.data)
    assert any(p.key == "fxamp.plan" for p in model.metadata_props)
    assert run("export", MODEL, "-o", os.devnull) == 0
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_export_writes_nothing_when_a_later_step_fails(tmp_path, capsys, onnx_available):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"the old model")
    (tmp_path / "afile").write_text("x")
    # the report cannot be written: refused before any work, -o untouched
    assert run("export", MODEL, "-o", str(out), "--report",
               str(tmp_path / "afile" / "r.md")) == 2
    err = capsys.readouterr().err
    assert "afile is a file, not a directory" in err and "Traceback" not in err
    assert out.read_bytes() == b"the old model"
    # the report's backend fails after the export: still nothing written
    pytest.importorskip("onnxruntime")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed: the report would succeed")
    except ImportError:
        pass
    report = tmp_path / "report.md"
    assert run("export", MODEL, "-o", str(out), "--report", str(report),
               "--backend", "tensorrt") == 2
    err = capsys.readouterr().err
    assert "needs the TensorRT Python package" in err and "Traceback" not in err
    assert out.read_bytes() == b"the old model" and not report.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "model.onnx"]


@pytest.mark.parametrize("spelling", ["same", "relative", "symlink"])
def test_export_refuses_one_file_for_the_model_and_the_report(tmp_path, capsys, monkeypatch,
                                                              spelling):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"the old model")
    monkeypatch.chdir(tmp_path)
    report = {"same": str(out), "relative": "./sub/../model.onnx",
              "symlink": str(tmp_path / "link.md")}[spelling]
    (tmp_path / "sub").mkdir()
    if spelling == "symlink":
        os.symlink(out, report)
    assert run("export", MODEL, "-o", str(out), "--report", report) == 2
    err = capsys.readouterr().err
    assert "are the same file" in err and "--report" in err and "Traceback" not in err
    assert "rewriting" not in err  # refused before any work
    assert out.read_bytes() == b"the old model"
