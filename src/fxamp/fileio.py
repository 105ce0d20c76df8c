"""Atomic file writes: every file fxamp writes goes through here.

The data is written to a temporary file in the target's directory, flushed and fsync'ed,
then moved over the target with :func:`os.replace` (atomic on POSIX and Windows within one
file system). A process killed mid-write, a full disk or any exception leaves the old file
as it was (the temporary file is removed when Python can still run). Missing parent
directories are created. Any OS-level failure becomes an :class:`OutputFileError` that names
the path, the cause and what to do.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import tempfile
from typing import Callable, Iterator, Tuple

from .errors import OutputFileError

log = logging.getLogger(__name__)

__all__ = ["atomic_write_text", "atomic_write_bytes", "atomic_directory", "output_error"]


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


def output_error(path: str, err: OSError) -> OutputFileError:
    """An :class:`OutputFileError` for ``err`` raised while writing ``path``."""
    cause = err.strerror or str(err) or type(err).__name__
    made = OutputFileError(f"cannot write {path}: {cause}\n  what to do: {_advice(err)}")
    made.errno = err.errno
    made.filename = path
    return made


def _target(path: str) -> str:
    """The real file to replace (a symlink is written through, not replaced)."""
    path = os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


def _prepare(path: str) -> str:
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
