"""What the ``fxamp`` command needs of the process it runs in, whatever the terminal:

- :func:`streams_for_any_encoding`: standard output and error write on any encoding (an
  ASCII or cp1252 console, ``PYTHONIOENCODING=ascii``): a character the encoding lacks is
  written as its ASCII spelling (``→`` as ``->``), else ``?``, never a UnicodeEncodeError;
- :func:`result_stream` / :func:`write_result`: a command whose result goes to standard
  output refuses a closed one (``fxamp plan >&-``) with one line, and a failed write (a
  closed pipe, ``> /dev/full``) is an :class:`~fxamp.errors.FxampError`, not a traceback;
- :func:`terminating_raises`: SIGTERM and SIGHUP end the command through
  :class:`Terminated`, like Ctrl-C through KeyboardInterrupt, so its ``finally`` and
  ``with`` blocks remove the temporary files and folders it made (``fileio.Staging``);
- :func:`file_size_errors`: a write past the per-file size limit (``ulimit -f``) is an
  error naming the limit, never a kill by SIGXFSZ.
"""
from __future__ import annotations

import codecs
import contextlib
import os
import signal
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, TextIO, Tuple

from ..errors import FxampError

__all__ = ["Terminated", "terminating_raises", "streams_for_any_encoding", "result_stream",
           "write_result", "file_size_errors", "ERRORS"]

#: the codecs error handler :func:`streams_for_any_encoding` gives the standard streams
ERRORS = "fxamp-ascii"

#: the ASCII spelling of the characters fxamp's own output uses
_ASCII = {"\u2192": "->", "\u2190": "<-", "\u2014": "-", "\u2013": "-", "\u2026": "...",
          "\u00d7": "x", "\u2264": "<=", "\u2265": ">=", "\u00b7": ".", "\u2018": "'",
          "\u2019": "'", "\u201c": '"', "\u201d": '"'}


def _ascii_fallback(err: UnicodeError) -> Tuple[str, int]:
    """The codecs error handler: each character the encoding lacks as its ASCII spelling,
    else ``?``."""
    if not isinstance(err, UnicodeEncodeError):
        raise err
    text = err.object[err.start:err.end]
    return "".join(_ASCII.get(ch, "?") for ch in text), err.end


codecs.register_error(ERRORS, _ascii_fallback)


@contextlib.contextmanager
def streams_for_any_encoding() -> Iterator[None]:
    """Within the block, ``sys.stdout`` and ``sys.stderr`` write every character their
    encoding lacks as its ASCII spelling (``->`` for ``→``) or ``?``; their error handlers
    are put back after it. A stream that is closed or cannot be reconfigured is left."""
    changed: List[Tuple[Any, Optional[str]]] = []
    for stream in (sys.stdout, sys.stderr):
        if stream is None or not hasattr(stream, "reconfigure"):
            continue
        with contextlib.suppress(Exception):  # (a closed or detached stream)
            previous = stream.errors
            stream.reconfigure(errors=ERRORS)
            changed.append((stream, previous))
    try:
        yield
    finally:
        for stream, previous in changed:
            with contextlib.suppress(Exception):
                stream.reconfigure(errors=previous)


def result_stream(command: str, hint: str = "") -> TextIO:
    """``sys.stdout``, where ``command`` writes its result; FxampError when it is closed
    (``>&-``), naming what to do (``hint``: another way to get the result)."""
    if sys.stdout is None:
        raise FxampError(f"standard output is closed, and fxamp {command} writes its result "
                         f"there; what to do: redirect it to a file (> FILE){hint}")
    return sys.stdout


def write_result(command: str, text: str, hint: str = "") -> None:
    """Write ``text`` to standard output and flush it; a failed write (a closed pipe, a full
    device) is an FxampError naming the cause. Standard output then points at
    ``os.devnull``, so the interpreter's own flush at exit does not fail again."""
    stream = result_stream(command, hint)
    try:
        stream.write(text)
        stream.flush()
    except OSError as err:
        with contextlib.suppress(Exception):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        raise FxampError(f"cannot write the result to standard output: "
                         f"{err.strerror or err}; what to do: write it to a file"
                         f"{hint or ' (> FILE)'}") from None


class Terminated(BaseException):
    """A termination signal (SIGTERM, SIGHUP) received while a command runs, raised in the
    main thread as KeyboardInterrupt is for SIGINT, so every ``finally`` and ``with`` on
    the way out runs: temporary files and folders are removed, old outputs stay."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        """The signal's name (``SIGTERM``)."""
        return signal.Signals(self.signum).name


#: the signals that end a command through :class:`Terminated` (where the platform has them)
_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


#: signal -> the handler :func:`terminating_raises` replaced, while it is in place
_REPLACED: Dict[int, Any] = {}


def _defaults_in_child() -> None:
    """In a process forked while a command runs (a DataLoader worker, a fork pool): the
    signals get back the handlers they had before :func:`terminating_raises`, so such a
    process ends on SIGTERM as it would without fxamp."""
    for sig, handler in list(_REPLACED.items()):
        with contextlib.suppress(Exception):
            signal.signal(sig, handler)
    _REPLACED.clear()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_defaults_in_child)


@contextlib.contextmanager
def terminating_raises() -> Iterator[None]:
    """Within the block, a termination signal raises :class:`Terminated` in the main thread
    (once: a second one during the clean-up ends the process at once, as by default).
    Only signals left at their default action are taken (an ignored SIGHUP, under
    ``nohup``, stays ignored); the handlers are put back after the block. Off the main
    thread nothing changes (Python runs signal handlers in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: Dict[int, Any] = {}

    def terminate(signum: int, frame: Any) -> None:
        for sig in previous:
            signal.signal(sig, signal.SIG_DFL)
        raise Terminated(signum)

    for sig in _TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, terminate)
    _REPLACED.update(previous)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
            _REPLACED.pop(sig, None)


@contextlib.contextmanager
def file_size_errors() -> Iterator[None]:
    """Within the block, a write past this process's per-file size limit (``ulimit -f``,
    RLIMIT_FSIZE) fails with ``OSError`` EFBIG, which names the limit (``fileio``), instead
    of SIGXFSZ killing the process without a word. Python ignores SIGXFSZ at start-up; this
    covers an interpreter that did not (embedded, ``install_signal_handlers`` off). The
    handler is put back after the block; off the main thread nothing changes."""
    sig = getattr(signal, "SIGXFSZ", None)
    if sig is None or threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(sig) is not signal.SIG_DFL:
        yield
        return
    signal.signal(sig, signal.SIG_IGN)
    _REPLACED[sig] = signal.SIG_DFL
    try:
        yield
    finally:
        signal.signal(sig, signal.SIG_DFL)
        _REPLACED.pop(sig, None)
