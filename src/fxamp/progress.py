"""Progress bars for fxamp's long work, shown only on a terminal.

Calibration over many batches, the tolerance search, ONNX export and the export front
end's ``torch.export`` can take minutes. While one runs, a ``tqdm`` bar on stderr shows what
is going on and how long it has taken (a background thread redraws it every half second,
so a single long call still shows its elapsed time). Nothing is drawn when stderr is not a
terminal (a log file, a pipe, CI), or when the environment variable ``FXAMP_PROGRESS`` is
``0`` / ``off``. Bars are removed from the screen when their work ends (``leave=False``).

Three ways in, one per shape of work::

    for batch in track(batches, "calibration", unit="batch"): ...   # a loop
    @shows("torch.export")                                          # one long call
    def _export(...): ...
    advance(postfix="error 3e-3")   # one step of the innermost bar of this thread, if any
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, List, Optional, TextIO, TypeVar, Union

__all__ = ["shown", "progress", "track", "shows", "advance"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
_local = threading.local()  # .bars: the open bars of this thread, innermost last
TICK_S = 0.5


def shown(file: Optional[TextIO] = None) -> bool:
    """Whether a bar would be drawn on ``file`` (default: stderr): a terminal, and
    ``FXAMP_PROGRESS`` is not ``0`` / ``off`` / ``no`` / ``false``."""
    if os.environ.get("FXAMP_PROGRESS", "").strip().lower() in ("0", "off", "no", "false"):
        return False
    stream = file if file is not None else sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class _NoBar:
    """What ``progress`` yields when nothing is drawn: the calls a bar takes, doing nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass


def _bars() -> List[Any]:
    if not hasattr(_local, "bars"):
        _local.bars = []
    return _local.bars


@contextlib.contextmanager
def progress(desc: str, total: Optional[int] = None, unit: str = "it",
             file: Optional[TextIO] = None) -> Iterator[Any]:
    """A bar for the work inside the ``with`` block (a ``tqdm`` bar on a terminal, else an
    object with the same ``update`` / ``set_postfix_str`` that draws nothing)."""
    stream = file if file is not None else sys.stderr
    if not shown(stream):
        bar: Any = _NoBar()
        _bars().append(bar)
        try:
            yield bar
        finally:
            _bars().pop()
        return
    from tqdm import tqdm  # lazily: importing fxamp stays light

    bar = tqdm(total=total, desc=f"fxamp: {desc}", unit=unit, file=stream, leave=False,
               dynamic_ncols=True, mininterval=0.1)
    stop = threading.Event()

    def tick() -> None:  # keep the elapsed time moving during one long call
        while not stop.wait(TICK_S):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="fxamp-progress", daemon=True)
    ticker.start()
    _bars().append(bar)
    try:
        yield bar
    finally:
        _bars().pop()
        stop.set()
        ticker.join()
        bar.close()


def track(iterable: Iterable[T], desc: str, total: Optional[int] = None, unit: str = "it",
          file: Optional[TextIO] = None) -> Iterator[T]:
    """Iterate ``iterable`` with a bar (``total`` defaults to its ``len`` where it has one)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with progress(desc, total, unit, file) as bar:
        for item in iterable:
            yield item
            bar.update()


def shows(desc: Union[str, Callable[..., str]], unit: str = "it") -> Callable[[F], F]:
    """Decorate a long function: a bar (elapsed time, steps from ``advance``) while it runs.
    ``desc`` is a string or a function of the call's arguments that returns one."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            text = desc(*args, **kwargs) if callable(desc) else desc
            with progress(text, unit=unit):
                return fn(*args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


def advance(n: int = 1, postfix: Optional[str] = None) -> None:
    """Count ``n`` steps on the innermost open bar of this thread (none open: nothing)."""
    bars = _bars()
    if bars:
        bars[-1].update(n)
        if postfix is not None:  # steps counted this way are slow ones: draw each
            bars[-1].set_postfix_str(postfix)
