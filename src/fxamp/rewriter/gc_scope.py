"""Garbage collection during a rewrite scans only what the rewrite allocates.

A rewrite allocates many short-lived objects (fake tensors, graph nodes), so Python's cyclic
collector runs a full (oldest-generation) collection once or twice per rewrite, each one a
scan of every object in the process — with torch, torchvision, timm or transformers loaded,
0.2-0.7 s on a small CPU, 10-25% of a rewrite. ``young_objects_only`` moves the objects that
exist before the rewrite to the permanent generation (``gc.freeze``) for its duration and
back after it (``gc.unfreeze``): collections during the rewrite still free its own garbage,
nothing is freed early (frozen objects count as roots), and the process's older garbage is
collected by the next full collection after the rewrite, as it would have been. Nothing is
done when the collector is disabled, the program froze objects itself, or another Python
thread is running: freezing is process-wide (another thread's older garbage would wait for
the end of the rewrite), and the gain is small (swin_tiny, mobilevit_xxs: up to 10-15%
of a rewrite with timm loaded; resnet18, a tiny GPT-2: within the noise).
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
from typing import Iterator, List, Optional

_LOCK = threading.Lock()
_ACTIVE = [False]
#: the thread whose block froze the objects (None: no block froze them)
_FREEZER: List[Optional[int]] = [None]


#: threads that allocate nothing the freeze could hold back (tqdm's monitor, which
#: torch.fx's interpreter starts, only sleeps)
_IDLE_THREADS = frozenset({"tqdm_monitor"})


def other_threads() -> bool:
    """Whether a Python thread other than this one (and idle helpers) is running."""
    me = threading.current_thread()
    return any(t is not me and t.name not in _IDLE_THREADS for t in threading.enumerate())


@contextlib.contextmanager
def young_objects_only() -> Iterator[None]:
    """Freeze the existing objects for the duration of the block (outermost block only;
    not while another thread runs)."""
    with _LOCK:
        mine = not _ACTIVE[0] and gc.isenabled() and gc.get_freeze_count() == 0 \
            and not other_threads()
        if mine:
            _ACTIVE[0], _FREEZER[0] = True, threading.get_ident()
            gc.freeze()
    try:
        yield
    finally:
        if mine:
            with _LOCK:
                gc.unfreeze()
                _ACTIVE[0], _FREEZER[0] = False, None


def _after_fork_in_child() -> None:
    """In a forked child (``os.register_at_fork``): a new lock, and the objects another
    thread's block froze unfrozen (that thread is not in the child, so its block never
    ends there); a block of the forking thread itself ends in the child as it would have."""
    global _LOCK
    if _FREEZER[0] == threading.get_ident():
        return
    _LOCK = threading.Lock()
    if _ACTIVE[0]:
        gc.unfreeze()
        _ACTIVE[0], _FREEZER[0] = False, None


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)
