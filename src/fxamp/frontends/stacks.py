"""Cheaper ``node.stack_trace`` capture for torch.fx tracing, with the same text.

``fx.Tracer(record_stack_traces=True)`` captures, for every node, the whole Python stack
(``CapturedTraceback.extract().summary()``: every frame symbolized and its source line read),
then keeps the frames from the outermost ``forward`` on, drops torch's "uninteresting" files
and formats them. That was about 60 % of fxamp's trace time. :func:`stack_trace` walks the frame
objects instead, builds ``FrameSummary`` objects only for the frames it keeps, and caches the
formatted text per distinct stack, producing the text fx would: the innermost frame is fx's own
``TracerBase.create_node`` line that captured the stack, as in fx's text.
"""
from __future__ import annotations

import functools
import inspect
import traceback
import types
from typing import Dict, Optional, Tuple

import torch.fx as fx

_Key = Tuple[Tuple[str, int, str], ...]


@functools.lru_cache(maxsize=1)
def _capture_frame() -> Optional[Tuple[str, int, str]]:
    """(file, line, name) of the line in ``TracerBase.create_node`` that captures the stack
    (the innermost frame of fx's text), or None when this torch has no such line."""
    fn = fx.proxy.TracerBase.create_node
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    hits = [i for i, line in enumerate(lines) if "CapturedTraceback.extract()" in line]
    if len(hits) != 1:
        return None
    return fn.__code__.co_filename, start + hits[0], fn.__code__.co_name


@functools.lru_cache(maxsize=1)
def _uninteresting() -> frozenset:
    from torch.fx.experimental.symbolic_shapes import uninteresting_files
    return frozenset(uninteresting_files())


def supported(tracer: fx.Tracer) -> bool:
    """Whether :func:`stack_trace` reproduces ``tracer``'s own capture exactly."""
    return _capture_frame() is not None and not getattr(
        tracer, "_record_forward_stack_traces_only", False)


class StackCache:
    """Formatted stack traces by stack (one tracer run; source lines may change between)."""

    def __init__(self) -> None:
        self.texts: Dict[_Key, str] = {}

    def stack_trace(self, frame: Optional[types.FrameType]) -> str:
        """fx's stack-trace text for a node created with ``frame`` as the caller of
        ``TracerBase.create_node`` ('' when no ``forward`` frame is on the stack)."""
        frames = []
        while frame is not None:
            code = frame.f_code
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        frames.reverse()  # outermost first, as in fx's summary
        capture = _capture_frame()
        assert capture is not None
        frames.append(capture)
        first = next((i for i, f in enumerate(frames) if f[2] == "forward"), -1)
        if first < 0:
            return ""
        skip = _uninteresting()
        key: _Key = tuple(f for f in frames[first:] if f[0] not in skip)
        text = self.texts.get(key)
        if text is None:
            summary = traceback.StackSummary.from_list(
                [traceback.FrameSummary(f, line, name) for f, line, name in key])
            text = "".join(summary.format()).strip()
            self.texts[key] = text
        return text
