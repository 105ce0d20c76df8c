"""Atomic file writes: every file fxamp writes goes through here.

The data is written to a temporary file in the target's directory, flushed and fsync'ed,
then moved over the target with :func:`os.replace` (atomic on POSIX and Windows within one
file system). A process killed mid-write, a full disk or any exception leaves the old file
as it was (the temporary file is removed when Python can still run). Missing parent
directories are created. Any OS-level failure becomes an :class:`OutputFileError` that names
the path, the cause and what to do.

A target that is not a regular file — a device such as ``/dev/null``, a FIFO, a socket, or
a process's stream (``/dev/stdout``, ``/proc/self/fd/N``) — is written straight into
(opened for writing; for ``/dev/stdout`` this process's own descriptor), never replaced: a
rename would put a regular file in its place.
:class:`Staging` keeps the files of a command that writes several in a temporary directory
until the command has succeeded.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .errors import OutputFileError

log = logging.getLogger(__name__)

__all__ = ["atomic_write_text", "atomic_write_bytes", "atomic_directory", "output_error",
           "writes_in_place", "Staging", "make_temporary_directory",
           "temporary_directory_named"]


def _limit(value: int) -> str:
    """A resource limit as ``ulimit`` shows it: bytes, or ``unlimited``."""
    import resource

    return "unlimited" if value == resource.RLIM_INFINITY else f"{value} bytes"


def _too_large_advice(path: str) -> str:
    """What to do about EFBIG ("File too large") while writing ``path``: this process's
    per-file size limit (``ulimit -f``, RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write
    fails instead of the process being killed) when one is set, else the file system's
    largest file.

    Args:
        path: the file whose write failed.

    Returns:
        The advice, naming the limit in bytes.
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        limited = soft != resource.RLIM_INFINITY
    except (ImportError, OSError, ValueError, AttributeError):  # no such limit (Windows)
        limited = False
    if limited:
        most = "" if hard == soft else f", hard limit {_limit(hard)}"
        blocks = f" (ulimit -f {soft // 1024}, in 1024-byte blocks)" if soft >= 1024 else ""
        return (f"the file is larger than this process may write: its per-file size limit "
                f"(RLIMIT_FSIZE) is {soft} bytes{blocks}{most}; setting TMPDIR or writing "
                "elsewhere does not help. Raise "
                "the limit in the shell that runs fxamp (ulimit -f unlimited, or a size above "
                "the file's) and run again; the old file is unchanged")
    where = os.path.dirname(os.path.abspath(path))
    return (f"the file system of {where} cannot hold a file this large (FAT32, for one, "
            "stops at 4 GiB): write to another file system (fxamp stages some outputs in the "
            "temporary directory: set TMPDIR to a directory on another file system too) and "
            "run again; the old file is unchanged")


def _advice(err: OSError) -> str:
    if isinstance(err, PermissionError):
        return "choose a writable location or fix the permissions of the file and its directory"
    if err.errno == errno.ENOSPC:
        return "free disk space (or write elsewhere) and run again; the old file is unchanged"
    if err.errno == errno.EROFS:
        return "the file system is read-only: write elsewhere"
    if isinstance(err, (NotADirectoryError, FileExistsError)):
        return "choose another path (or move the file out of the way)"
    if isinstance(err, IsADirectoryError):
        return "the path is a directory: give a file name"
    return "check the path and run again; the old file is unchanged"


def temporary_directory_named() -> str:
    """The temporary directory as a person sets it: ``TMPDIR=/scratch`` when the variable
    is set (``TEMP``, ``TMP`` likewise), else ``/tmp (TMPDIR is not set)``; where Python's
    ``tempfile`` fell back from an unusable ``TMPDIR`` to another directory, both."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value:
            try:
                used = tempfile.gettempdir()
            except OSError:
                return f"{name}={value}"
            if os.path.realpath(value) != os.path.realpath(used):
                return f"{used} ({name}={value} is not usable)"
            return f"{name}={value}"
    return f"{tempfile.gettempdir()} (TMPDIR is not set)"


#: the folder of each file :class:`Staging` keeps (real path) -> the output it goes to
_STAGED: Dict[str, str] = {}


def _staged_target(path: str) -> Optional[str]:
    """The output a file of a :class:`Staging` folder is staged for (the target, or a
    companion file beside it), or None for any other path."""
    real = os.path.realpath(os.path.abspath(path))
    folder, name = os.path.split(real)
    target = _STAGED.get(folder)
    if target is None:
        return None
    if name == os.path.basename(os.path.abspath(target)):
        return target
    return os.path.join(os.path.dirname(target), name)


def _fxamp_temporary(path: str) -> bool:
    """Whether ``path`` lies in one of fxamp's own temporary folders (``fxamp-*.tmp`` in
    the temporary directory: :class:`Staging`, in-place targets' copies)."""
    try:
        root = os.path.realpath(tempfile.gettempdir())
    except OSError:
        return False
    rest = os.path.relpath(os.path.realpath(os.path.abspath(path)), root)
    first = rest.split(os.sep)[0]
    return first.startswith("fxamp-") and first.endswith(".tmp") and first != rest


def _temporary_advice(err: OSError) -> str:
    where = temporary_directory_named()
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        problem = "the temporary directory is full"
    elif isinstance(err, PermissionError) or err.errno == errno.EROFS:
        problem = "the temporary directory is not writable"
    else:
        problem = "the write into the temporary directory failed"
    return (f"{problem}: {where}. fxamp stages its outputs there until the command "
            "succeeds; set TMPDIR to a writable directory with room (TMPDIR=/path/with/space "
            "fxamp ...) and run again; the outputs are unchanged")


def output_error(path: str, err: OSError) -> OutputFileError:
    """An :class:`OutputFileError` for ``err`` raised while writing ``path`` (for a file of
    fxamp's own temporary folders, naming the temporary directory and ``TMPDIR``, and the
    output it is staged for; for "File too large", the per-file size limit)."""
    cause = err.strerror or str(err) or type(err).__name__
    if err.errno == errno.EFBIG:  # the size limit holds wherever the file is staged
        advice = _too_large_advice(path)
    else:
        advice = _temporary_advice(err) if _fxamp_temporary(path) else _advice(err)
    target = _staged_target(path)
    shown = f"{target} (staged as {path})" if target else path
    made = OutputFileError(f"cannot write {shown}: {cause}\n  what to do: {advice}")
    made.errno = err.errno
    made.filename = path
    return made


def make_temporary_directory() -> str:
    """A new ``fxamp-*.tmp`` folder in the temporary directory; OutputFileError naming
    ``TMPDIR`` when none can be made (full or not writable, and so every directory
    Python's ``tempfile`` falls back to)."""
    try:
        return tempfile.mkdtemp(prefix="fxamp-", suffix=".tmp")
    except OSError as err:
        tmpdir = os.environ.get("TMPDIR")
        setting = f"TMPDIR={tmpdir}" if tmpdir else "TMPDIR is not set"
        made = OutputFileError(
            f"cannot make a temporary folder ({setting}): {str(err) or type(err).__name__}"
            "\n  what to do: set TMPDIR to a writable directory with room "
            "(TMPDIR=/path/with/space fxamp ...) and run again; fxamp stages its outputs "
            "there until the command succeeds")
        made.errno = err.errno
        raise made from err


def _target(path: str) -> str:
    """The real file to replace (a symlink is written through, not replaced)."""
    path = os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


_STREAM_DIRS = ("/proc/", "/dev/fd/")


def writes_in_place(path: str) -> bool:
    """Whether ``path`` is written straight into rather than replaced: it exists and is
    not a regular file or a directory (a character or block device, a FIFO, a socket), or
    it leads through a process's file descriptors (``/dev/stdout``, ``/proc/self/fd/1``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if stat.S_ISDIR(mode):
        return False
    if not stat.S_ISREG(mode):
        return True
    link, hops = os.path.abspath(os.fspath(path)), 0
    while hops < 40:
        if link.startswith(_STREAM_DIRS):
            return True
        if not os.path.islink(link):
            return False
        link = os.path.join(os.path.dirname(link), os.readlink(link))
        hops += 1
    return False


def _own_descriptor(path: str) -> Optional[int]:
    """N when ``path`` leads to this process's file descriptor N (``/dev/stdout``,
    ``/dev/fd/N``, ``/proc/self/fd/N``)."""
    link = os.path.abspath(os.fspath(path))
    mine = (f"/proc/{os.getpid()}/fd/", "/proc/self/fd/", "/proc/thread-self/fd/",
            "/dev/fd/")
    for _ in range(40):
        for prefix in mine:
            rest = link[len(prefix):] if link.startswith(prefix) else ""
            if rest.isdigit():
                return int(rest)
        if not os.path.islink(link):
            return None
        link = os.path.join(os.path.dirname(link), os.readlink(link))
    return None


def _write_in_place(path: str, fill: Callable[[int], None]) -> str:
    """Write into the existing non-regular file ``path`` (no temporary file, no rename)."""
    for stream in (sys.stdout, sys.stderr):  # what was printed before comes first
        with contextlib.suppress(Exception):
            stream.flush()
    own = _own_descriptor(path)
    try:
        if own is not None:  # /dev/stdout: this process's descriptor, at its own offset
            fill(own)
            return os.fspath(path)
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_BINARY", 0) |
                     getattr(os, "O_CLOEXEC", 0))
        try:
            fill(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise output_error(os.fspath(path), err) from err
    return os.fspath(path)


def _prepare(path: str, create: bool = True) -> str:
    """The real file to replace, checked (not a directory, writable, its directory there
    or creatable); missing directories are made when ``create``."""
    target = _target(path)
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, "the file is read-only", path)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        above = directory
        while not os.path.exists(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise NotADirectoryError(errno.ENOTDIR, f"{above} is a file, not a directory",
                                     path)
        if not create:
            return target
        os.makedirs(directory, exist_ok=True)
        log.info("created directory %s", directory)
    return target


def _keep_mode(tmp: str, target: str) -> None:
    """Give ``tmp`` the mode of the file it replaces (a new file keeps the umask's mode)."""
    try:
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        return
    os.chmod(tmp, mode)


def _open_temp(directory: str, name: str) -> Tuple[int, str]:
    """A new hidden file next to the target, created with mode 0o666 less the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def _fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, getattr(os, "O_DIRECTORY", 0) | os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write(path: str, fill: Callable[[int], None]) -> str:
    if writes_in_place(path):
        return _write_in_place(path, fill)
    try:
        target = _prepare(path)
        directory, name = os.path.split(target)
        fd, tmp = _open_temp(directory, name)
    except OSError as err:
        raise output_error(os.fspath(path), err) from err
    try:
        try:
            fill(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        _keep_mode(tmp, target)
        os.replace(tmp, target)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise output_error(os.fspath(path), err) from err
        raise
    _fsync_directory(directory)
    return os.fspath(path)


def atomic_write_bytes(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (the old file survives any failure)."""
    def fill(fd: int) -> None:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    return _write(path, fill)


def atomic_write_text(path: str, text: str, encoding: str = "utf-8") -> str:
    """Write ``text`` to ``path`` atomically, encoded as ``encoding`` (default UTF-8)."""
    return atomic_write_bytes(path, text.encode(encoding))


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
    """For writers that need a file name (``onnx.save`` with external data): yields a
    temporary directory next to ``path``; on success every file the block wrote there is
    moved into ``path``'s directory (the file named like ``path`` last), on failure the
    directory is removed and the old files are untouched."""
    if writes_in_place(path):
        with _directory_into(path) as tmpdir:
            yield tmpdir
        return
    try:
        target = _prepare(path)
        tmpdir = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                                  dir=os.path.dirname(target))
    except OSError as err:
        raise output_error(os.fspath(path), err) from err
    try:
        yield tmpdir
        name = os.path.basename(target)
        others = sorted(f for f in os.listdir(tmpdir) if f != name)
        for f in others + [name]:
            src = os.path.join(tmpdir, f)
            with open(src, "rb") as fh:
                os.fsync(fh.fileno())
            _keep_mode(src, os.path.join(os.path.dirname(target), f))
            os.replace(src, os.path.join(os.path.dirname(target), f))
    except OSError as err:
        raise output_error(os.fspath(path), err) from err
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    _fsync_directory(os.path.dirname(target))


@contextlib.contextmanager
def _directory_into(path: str) -> Iterator[str]:
    """atomic_directory for a target written in place: the block writes into a private
    temporary directory, then the file named like ``path`` is copied into ``path``."""
    tmpdir = make_temporary_directory()
    try:
        yield tmpdir
        name = os.path.basename(os.path.abspath(path))
        others = sorted(f for f in os.listdir(tmpdir) if f != name)
        if others:
            raise output_error(os.fspath(path), OSError(
                errno.EINVAL, f"{path} is not a regular file, and the output has companion "
                f"files ({', '.join(others)}) that must lie beside it: write to a file"))
        copy_into(os.path.join(tmpdir, name), path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def copy_into(source: str, path: str) -> str:
    """Write the bytes of the file ``source`` to ``path`` as the writes here do (atomically,
    or straight into a non-regular target)."""
    def fill(fd: int) -> None:
        with open(source, "rb") as fh:
            while True:
                chunk = fh.read(1 << 20)
                if not chunk:
                    return
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
    return _write(path, fill)


def _probe(target: str) -> None:
    """Create and remove a temporary file beside ``target`` when its directory exists: the
    write there will work (permissions, read-only or special file systems)."""
    directory = os.path.dirname(target)
    if os.path.isdir(directory):
        fd, tmp = _open_temp(directory, os.path.basename(target))
        os.close(fd)
        os.unlink(tmp)


class Staging:
    """The outputs of a command that writes several files, kept in a temporary directory
    until it has succeeded: :meth:`path` names where to write a target's file (and any
    companion files beside it), :meth:`commit` writes each to its target (companions first,
    each write atomic or in place); closing without a commit leaves every target as it was.

    The targets are checked when they are named (not a directory, writable), so a bad path
    fails before the work."""

    def __init__(self) -> None:
        self.root = make_temporary_directory()
        self._entries: List[Tuple[str, str]] = []

    def path(self, target: str) -> str:
        """Where to write the file that goes to ``target``."""
        target = os.fspath(target)
        if not writes_in_place(target):
            try:
                _probe(_prepare(target, create=False))
            except OSError as err:
                raise output_error(target, err) from err
        folder = os.path.join(self.root, str(len(self._entries)))
        os.mkdir(folder)
        self._entries.append((folder, target))
        _STAGED[os.path.realpath(folder)] = target
        return os.path.join(folder, os.path.basename(os.path.abspath(target)))

    def commit(self) -> None:
        """Write every staged file to its target."""
        staged = []
        for folder, target in self._entries:
            name = os.path.basename(os.path.abspath(target))
            others = sorted(f for f in os.listdir(folder) if f != name)
            if others and writes_in_place(target):
                raise output_error(target, OSError(
                    errno.EINVAL, f"{target} is not a regular file, and the output has "
                    f"companion files ({', '.join(others)}) that must lie beside it"))
            staged.append((folder, target, name, others))
        for folder, target, name, others in staged:
            for f in others:
                copy_into(os.path.join(folder, f),
                          os.path.join(os.path.dirname(os.path.abspath(target)), f))
            if os.path.exists(os.path.join(folder, name)):
                copy_into(os.path.join(folder, name), target)

    def close(self) -> None:
        for folder, _ in self._entries:
            _STAGED.pop(os.path.realpath(folder), None)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
