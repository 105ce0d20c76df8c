"""What torch prints while a step fails, kept off the terminal: the ONNX exporters print
torch.fx's traceback of the failing generated forward (``GraphModule`` prints it to
``sys.stderr`` before re-raising), and the TorchScript exporter's C++ log prints the graph
at the exception (to file descriptor 1). The command's one-line error says what failed; the
captured text goes to the debug log (``--debug`` shows it). When the step succeeds the text
is printed where it would have gone."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator

log = logging.getLogger(__name__)

_STREAMS = (("stdout", 1), ("stderr", 2))


@contextlib.contextmanager
def _captured(into: Dict[str, str]) -> Iterator[None]:
    """Capture ``sys.stdout`` / ``sys.stderr`` and file descriptors 1 and 2; the text of
    each goes to ``into["stdout"]`` / ``into["stderr"]``."""
    python = {name: io.StringIO() for name, _ in _STREAMS}
    files, saved = {}, {}
    for name, fd in _STREAMS:
        with contextlib.suppress(Exception):
            getattr(sys, name).flush()
        files[name] = tempfile.TemporaryFile()
        try:
            saved[name] = os.dup(fd)
            os.dup2(files[name].fileno(), fd)
        except OSError:  # no such descriptor to capture: only Python's stream
            saved.pop(name, None)
    try:
        with contextlib.redirect_stdout(python["stdout"]), \
                contextlib.redirect_stderr(python["stderr"]):
            yield
    finally:
        for name, fd in _STREAMS:
            if name in saved:
                os.dup2(saved[name], fd)
                os.close(saved[name])
            files[name].seek(0)
            into[name] = (python[name].getvalue() +
                          files[name].read().decode("utf-8", "replace"))
            files[name].close()


def quiet(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose output is shown only when it succeeds (see the module)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        text: Dict[str, str] = {}
        try:
            with _captured(text):
                result = fn(*args, **kwargs)
        except BaseException:
            for name, value in text.items():
                if value.strip():
                    log.debug("%s of the failed step:\n%s", name, value.rstrip())
            raise
        for name, value in text.items():
            if value:
                getattr(sys, name).write(value)
        return result
    return call
