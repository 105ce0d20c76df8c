"""``weights=o2``: threads making the first calls of a freshly rewritten module at once get
what one thread gets, and each weight is cast once (the cache's fill is under its lock;
``fxamp/weight_cache.py``).

The overlap is forced: :class:`_Turns` lets one thread at a time run the code of
``weight_cache.py``, and at each function call and return there (Python or C) hands the turn
to a thread drawn from a seeded RNG, mostly keeping it (a thread runs a stretch, then another
catches up). A thread that waits past a few milliseconds (its turn's holder is blocked, e.g.
on the cache's lock) goes on anyway. Nothing of fxamp's is replaced: only the order in which
the threads run it is chosen.
"""
from __future__ import annotations

import random
import sys
import threading
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn

import fxamp
import fxamp.weight_cache

ROUNDS = 24
THREADS = 8
#: the chance that the thread holding the turn keeps it at the next call or return
STAY = 0.95


class _Turns:
    """One thread at a time in the code of ``path``, the next drawn at each call and return
    (see the module docstring)."""

    def __init__(self, path: str, seed: int, wait: float = 0.005) -> None:
        self.path, self.rng, self.wait = path, random.Random(seed), wait
        self.cond = threading.Condition()
        self.turn: Optional[int] = None
        self.alive: List[int] = []

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in this thread, taking turns with the other threads' ``run``."""
        me = threading.get_ident()
        with self.cond:
            self.alive.append(me)
        sys.setprofile(self._hook)
        try:
            return fn()
        finally:
            sys.setprofile(None)
            with self.cond:
                self.alive.remove(me)
                if self.turn == me:
                    self.turn = self.rng.choice(self.alive) if self.alive else None
                self.cond.notify_all()

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if frame.f_code.co_filename != self.path:
            return
        me = threading.get_ident()
        with self.cond:
            if self.turn is None or (self.turn == me and self.rng.random() > STAY):
                self.turn = self.rng.choice(self.alive)
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.turn == me, timeout=self.wait):
                self.turn = me  # (the holder is blocked elsewhere: go on)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def _rewrite() -> nn.Module:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    return fxamp.amp_rewrite(_model(), (x,),
                             fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                      policy="weights=o2"))


def test_o2_first_no_grad_calls_from_eight_threads_equal_one_threads_call_and_cast_once():
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _rewrite()(x)
    failed = []
    for round_ in range(ROUNDS):
        gm = _rewrite()  # a fresh module: every copy is filled by these calls
        turns = _Turns(fxamp.weight_cache.__file__, seed=round_)
        outs: List[Any] = [None] * THREADS
        start = threading.Barrier(THREADS)

        def call(i: int) -> None:
            start.wait()
            try:
                with torch.no_grad():
                    outs[i] = turns.run(lambda: gm(x))
            except Exception as exc:  # noqa: BLE001 - recorded, asserted below
                outs[i] = exc

        threads = [threading.Thread(target=call, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(isinstance(o, torch.Tensor) and torch.equal(o, want) for o in outs):
            failed.append((round_, [o if isinstance(o, Exception) else "differs"
                                    for o in outs if not isinstance(o, torch.Tensor)
                                    or not torch.equal(o, want)][:2]))
        # each weight was cast once, whichever thread cast it; later calls serve those copies
        cache, = fxamp.weight_cache.caches(gm)
        assert cache.casts == len(cache.slots) == 8, round_
        with torch.no_grad():
            assert torch.equal(gm(x), want)
        assert cache.casts == 8
    assert not failed, f"{len(failed)} of {ROUNDS} rounds: {failed[:3]}"
