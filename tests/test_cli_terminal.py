"""The fxamp command on any terminal and in any process state, run as a user runs it (a
subprocess): an ASCII console, a closed or full standard output, SIGTERM during an export,
a full or unusable temporary directory (``TMPDIR``)."""
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import pytest
import torch
import torch.nn as nn

import fxamp

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

    def forks():  # a process forked while the command runs says how it takes SIGTERM
        import signal
        pid = os.fork()
        if pid == 0:
            default = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            with open(os.environ["MARK"], "w") as f:
                f.write("default" if default else "fxamp's")
            os._exit(0)
        os.waitpid(pid, 0)
        return small()
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


def _fxamp_leftovers(tmpdir: Path) -> List[str]:
    """What fxamp's temporary folders left in ``tmpdir`` (torch's own caches, such as
    ``torchinductor_USER``, are not fxamp's)."""
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(("fxamp-", "tmp")))


# ------------------------------------------------------------------ SIGTERM during export
def _terminated(proc: subprocess.Popen) -> str:
    """SIGTERM to ``proc``; its stderr once it ended (it must end within a minute)."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("fxamp export did not end within a minute of SIGTERM")
    return err


def test_sigterm_during_an_export_leaves_no_temporary_folder_and_the_old_file(work: Path
                                                                              ) -> None:
    (work / "model.onnx").write_bytes(b"old")
    mark = work / "started"
    proc = subprocess.Popen([sys.executable, "-m", "fxamp", "export", "models.py:waits",
                             "--target", "cpu", "-o", "model.onnx", "--report", "r.md"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(TMPDIR=str(work / "tmpdir"), MARK=str(mark)))
    deadline = time.monotonic() + 120
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mark.exists(), proc.communicate()
    assert any(p.name.startswith("fxamp-") for p in (work / "tmpdir").iterdir()), \
        "the export stages its outputs in TMPDIR (else the test tests nothing)"
    err = _terminated(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "fxamp export: terminated by SIGTERM", err
    assert _fxamp_leftovers(work / "tmpdir") == []
    assert (work / "model.onnx").read_bytes() == b"old" and not (work / "r.md").exists()


def test_sigterm_while_the_onnx_file_is_written_leaves_no_temporary_folder(work: Path
                                                                           ) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "fxamp", "export", "models.py:small",
                             "--target", "cpu", "-o", "model.onnx"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(TMPDIR=str(work / "tmpdir")))
    seen = []
    for line in proc.stderr:  # (the step lines come flushed, one by one)
        seen.append(line)
        if "exporting to" in line:
            break
    assert seen and "exporting to" in seen[-1], "".join(seen)
    err = _terminated(proc)
    if proc.returncode == 0:  # (the export finished before the signal came: nothing to see)
        pytest.fail("the export ended before SIGTERM reached it; make the model larger")
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + err
    assert "fxamp export: terminated by SIGTERM" in err
    assert _fxamp_leftovers(work / "tmpdir") == []
    assert not (work / "model.onnx").exists()


def test_a_process_forked_by_a_command_takes_sigterm_as_by_default(work: Path) -> None:
    mark = work / "child"
    r = _fxamp("plan", "models.py:forks", "--target", "cpu", "-o", "p.plan", cwd=work,
               MARK=str(mark))
    assert r.returncode == 0, r.stderr
    assert mark.read_text() == "default"


# ------------------------------------------------------------------ standard output
def test_diff_on_an_ascii_stdout_writes_its_arrows_in_ascii(work: Path) -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(2, 8)
    for name, policy in (("a.plan", None), ("b.plan", "fp32:0")):
        gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(target="cpu", policy=policy))
        fxamp.plan_of(gm).save(str(work / name))
    r = _fxamp("diff", "a.plan", "b.plan", cwd=work, PYTHONIOENCODING="ascii")
    assert r.returncode == 1, r.stderr  # the plans differ
    assert "UnicodeEncodeError" not in r.stderr and r.stderr == ""
    assert "2 nodes changed precision: 2 FP16->FP32" in r.stdout
    md = _fxamp("diff", "a.plan", "b.plan", "--format", "markdown", cwd=work,
                encoding="cp1252", PYTHONIOENCODING="cp1252")  # (a Windows console)
    assert md.returncode == 1 and md.stderr == "", md.stderr
    assert "\u2014 2 nodes changed precision" in md.stdout, md.stdout  # (cp1252 has the dash)
    assert "`compute=fp16,target=cpu` -> `compute=fp16,target=cpu,fp32:0`" in md.stdout


def test_plan_with_a_closed_stdout_exits_2_with_one_line(work: Path) -> None:
    r = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "fxamp",
                        "plan", "models.py:small", "--target", "cpu"], capture_output=True,
                       text=True, cwd=work, timeout=300, env=_env())
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "fxamp plan: error: standard output is closed, and fxamp plan writes its result "
        "there; what to do: redirect it to a file (> FILE) or give -o FILE"], r.stderr
    written = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m",
                              "fxamp", "plan", "models.py:small", "--target", "cpu", "-o",
                              "p.plan"], capture_output=True, text=True, cwd=work,
                             timeout=300, env=_env())
    assert written.returncode == 0 and (work / "p.plan").read_text().startswith("# fxamp")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_plan_to_a_full_stdout_exits_2_with_one_line(work: Path) -> None:
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "fxamp", "plan", "models.py:small",
                            "--target", "cpu"], stdout=full, stderr=subprocess.PIPE,
                           text=True, cwd=work, timeout=300, env=_env())
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "fxamp plan: error: cannot write the result to standard output: No space left on "
        "device; what to do: write it to a file or give -o FILE"], r.stderr


# ------------------------------------------------------------------ TMPDIR
def _in_a_mount_namespace(script: str, *command: str, cwd: Path, **extra: str
                          ) -> subprocess.CompletedProcess:
    """``command`` run by ``sh -c script`` in a new user and mount namespace (where it may
    mount a small or read-only tmpfs without privileges); skipped where the system allows
    no such namespace, and failed there when CI is set (.ci/run runs on machines that allow
    it, so a skip there would hide the test)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("this system cannot make a user and mount namespace (unshare -rm) "
                        "and CI is set: the full and read-only TMPDIR tests need one; run CI "
                        "where unprivileged user namespaces are allowed")
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


def _read_only_tmp_script() -> str:
    """Shell commands that mount a read-only tmpfs over /tmp and /var/tmp, keeping visible
    what the command needs that lies under them (the Python environment, the checkout, the
    PYTHONPATH entries: a checkout under /tmp, as a CI clone may be): each is bound back
    from a holder of the old directory before the tmpfs is made read-only."""
    tops = ("/tmp", "/var/tmp")
    needed = {Path(p) for p in (sys.prefix, sys.base_prefix, ROOT, *os.environ.get(
        "PYTHONPATH", "").split(os.pathsep)) if p}
    needed |= {p.resolve() for p in needed}
    keep = sorted({str(p) for p in needed if any(str(p).startswith(t + "/") for t in tops)})
    steps = ["mount -t tmpfs -o size=16k tmpfs /mnt"]
    for n, top in enumerate(tops):
        steps += [f"mkdir /mnt/{n}", f"mount --bind {top} /mnt/{n}",
                  f"mount -t tmpfs -o size=16k tmpfs {top}"]
        for path in (k for k in keep if k.startswith(top + "/")):
            old = f"/mnt/{n}{path[len(top):]}"
            steps += [f"mkdir -p {shlex.quote(path)}",
                      f"mount --bind {shlex.quote(old)} {shlex.quote(path)}"]
        steps.append(f"mount -o remount,ro,size=16k tmpfs {top}")
    return " && ".join(steps)


def test_an_unusable_tmpdir_is_named_in_the_error(work: Path) -> None:
    # TMPDIR and every directory Python's tempfile falls back to are read-only
    r = _in_a_mount_namespace(
        _read_only_tmp_script() + ' && cd /tmp && exec "$@"', sys.executable, "-m", "fxamp",
        "export", "fxamp.demo:small_cnn", "--target", "cpu", "-o", "/dev/null", cwd=work,
        TMPDIR="/tmp/scratch")
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if "rewriting" not in line]
    assert lines[0].startswith("fxamp export: error: cannot make a temporary folder "
                               "(TMPDIR=/tmp/scratch): "), r.stderr
    assert lines[1:] == ["  what to do: set TMPDIR to a writable directory with room "
                         "(TMPDIR=/path/with/space fxamp ...) and run again; fxamp stages "
                         "its outputs there until the command succeeds"], r.stderr
