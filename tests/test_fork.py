"""A process forked while another thread is inside ``amp_rewrite`` can rewrite: the child
does not inherit fxamp's trace lock held by a thread it does not have, nor the patches that
thread installed (``_torch``'s fork hook, ``os.register_at_fork``).

The overlap is forced: the model's forward, run by the rewriting thread while it traces,
signals the test and waits until the fork is done. The child rewrites a model and exits;
the parent gives it a timeout, so a hang fails the test instead of hanging it.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import re
import subprocess
import sys
import threading
from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn as nn

import fxamp

CHILD_TIMEOUT_S = 30.0


#: by model token: the events its next forward signals and waits on (set by the test)
_ARMED: Dict[int, Dict[str, threading.Event]] = {}


class Waits(nn.Module):
    """Two linears; its forward, where the test armed it, tells the test that the rewrite
    is in flight and waits for it to fork. (Armed by a token object it holds: the rewrite
    runs the forward of a shadow of the model, another module object holding the same
    attributes.)"""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.token = object()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        armed = _ARMED.pop(id(self.token), None)
        if armed:
            armed["inside"].set()
            armed["forked"].wait(CHILD_TIMEOUT_S)
        return self.lin2(torch.relu(self.lin1(x)))


def _torch_own() -> Dict[str, Any]:
    """The attributes fxamp (and torch.fx) replace while they trace, as torch has them."""
    return {"Module.__setattr__": vars(nn.Module)["__setattr__"],
            "Module.__call__": vars(nn.Module)["__call__"],
            "Module.__getattr__": vars(nn.Module)["__getattr__"],
            "torch.is_grad_enabled": torch.is_grad_enabled,
            "Function.apply": vars(torch.autograd.Function)["apply"]}


def _child_rewrites(own: Dict[str, Any]) -> None:
    """In the forked child: torch's own attributes are back, and a rewrite completes (and
    gives the plan it gives in the parent). Exits non-zero when either fails."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gm = fxamp.amp_rewrite(Waits(), (torch.randn(2, 8),),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    plan = fxamp.plan_of(gm)
    if plan.nodes["lin1"].dtype != torch.bfloat16:
        raise SystemExit(plan.to_text())
    with torch.no_grad():
        gm(torch.randn(3, 8))
    now = _torch_own()  # (and after the rewrite, as before it)
    changed = [name for name, value in own.items() if now[name] is not value]
    if changed:
        raise SystemExit(f"still replaced in the child: {changed}")
    os._exit(0)


def _fork_during_a_rewrite(start: Callable[[Callable[[], None]], Any]) -> int:
    """Fork (with ``start(target)``, which returns something to wait on) while another
    thread holds the trace lock inside ``amp_rewrite``; the child's exit status (-1: it did
    not finish in time and was killed)."""
    own = _torch_own()
    model = Waits()
    inside, forked = threading.Event(), threading.Event()
    _ARMED[id(model.token)] = {"inside": inside, "forked": forked}
    errors = []

    def rewrite() -> None:
        try:
            fxamp.amp_rewrite(model, (torch.randn(2, 8),),
                              fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    thread = threading.Thread(target=rewrite)
    thread.start()
    try:
        assert inside.wait(CHILD_TIMEOUT_S), "the rewrite did not reach the model's forward"
        assert vars(nn.Module)["__setattr__"] is not own["Module.__setattr__"], \
            "the rewrite in flight has its patches installed (else the test tests nothing)"
        return start(lambda: _child_rewrites(own))
    finally:
        forked.set()
        thread.join(CHILD_TIMEOUT_S)
        assert not errors, errors
        gc.collect()


def _with_multiprocessing(target: Callable[[], None]) -> int:
    process = multiprocessing.get_context("fork").Process(target=target)
    process.start()
    process.join(CHILD_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
        return -1
    return process.exitcode


def _with_os_fork(target: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:  # the child
        try:
            target()
        finally:
            os._exit(1)
    return _waited(pid)


@pytest.mark.parametrize("start", [_with_multiprocessing, _with_os_fork],
                         ids=["multiprocessing-fork", "os.fork"])
def test_a_child_forked_during_a_rewrite_in_another_thread_completes_a_rewrite(
        start: Callable[[Callable[[], None]], int]) -> None:
    status = _fork_during_a_rewrite(start)
    assert status == 0, ("the child hung (killed after the timeout)" if status == -1 else
                         f"the child failed with exit status {status}")


def test_a_fork_inside_the_rewriting_thread_keeps_its_rewrite_going() -> None:
    """A fork from the thread that holds the lock (a model that forks in forward): the
    child's own frames still hold the lock and leave it as they entered; the child finishes
    that rewrite and makes another."""
    parent, children = os.getpid(), []

    class ForksInForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not children and os.getpid() == parent:
                pid = os.fork()
                children.append(pid)
                if pid == 0:
                    torch.set_num_threads(1)
            return self.lin(x)

    try:
        gm = fxamp.amp_rewrite(ForksInForward(), (torch.randn(2, 8),),
                               fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
        if os.getpid() != parent:  # the child: its rewrite completed; a second one too
            again = fxamp.amp_rewrite(nn.Linear(8, 2), (torch.randn(2, 8),),
                                      fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
            ok = all(fxamp.plan_of(m).nodes[n].dtype == torch.bfloat16
                     for m, n in ((gm, "lin"), (again, "linear")))
            os._exit(0 if ok else 1)
    except BaseException:  # noqa: BLE001 - the child's exit status says it
        if os.getpid() != parent:
            os._exit(1)
        raise
    assert children and children[0] > 0
    assert _waited(children[0]) == 0


def _waited(pid: int) -> int:
    """The exit status of child ``pid``; -1 when it did not finish in time (killed)."""
    waited = 0.0
    while waited < CHILD_TIMEOUT_S:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        threading.Event().wait(0.05)
        waited += 0.05
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -1


#: run in a fresh interpreter, alone (a thread an earlier test left running, or pytest-xdist's
#: own, would turn the gc scope off): a rewrite in the main thread freezes the heap; a thread
#: started inside it forks; the child prints its freeze count and rewrites a model
_FROZEN_FORK = r"""
import gc, os, sys, threading
import torch, torch.nn as nn
import fxamp

assert threading.active_count() == 1
seen = {}

def fork_and_wait():
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)
            frozen = gc.get_freeze_count()
            fxamp.amp_rewrite(nn.Linear(8, 2), (torch.randn(2, 8),),
                              fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
        except BaseException as err:
            print("child:", repr(err), file=sys.stderr, flush=True)
            os._exit(1)
        print("child freeze count", frozen, flush=True)
        os._exit(0)
    seen["status"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

class StartsAForkingThread(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        if "frozen" not in seen:
            seen["frozen"] = gc.get_freeze_count()
            thread = threading.Thread(target=fork_and_wait)
            thread.start()
            thread.join()
        return self.lin(x)

fxamp.amp_rewrite(StartsAForkingThread(), (torch.randn(2, 8),),
                  fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
print("parent freeze count", seen["frozen"], "child status", seen["status"], flush=True)
"""


@pytest.mark.slow
def test_a_child_forked_while_a_rewrite_froze_the_heap_unfreezes_it() -> None:
    """A rewrite alone in its process freezes the objects that exist before it
    (``rewriter/gc_scope.py``); a thread started inside it that forks gives a child where
    that rewrite never ends: the child's objects are unfrozen and its own rewrite runs."""
    done = subprocess.run([sys.executable, "-c", _FROZEN_FORK], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out = done.stdout + done.stderr[-2000:]
    assert done.returncode == 0, out
    assert re.search(r"parent freeze count [1-9]\d* child status 0", done.stdout), out
    assert "child freeze count 0\n" in done.stdout, out


def test_a_fork_while_another_thread_plans_the_first_call_plans_in_the_child():
    """In place, planned on its first call: a process forked while another thread plans
    the model computes its own call (planned anew in the child, like autocast) instead of
    waiting for a planning thread it does not have."""
    from test_block_mode_reliability import Gated as _Gated  # (waits on its gate)

    started, gate, ready = threading.Event(), threading.Event(), threading.Event()
    ready.set()
    torch.manual_seed(0)
    model = _Gated(started, gate)
    torch.manual_seed(0)
    ref = _Gated(threading.Event(), ready)
    fxamp.amp_rewrite(model, config="compute=bf16", inplace=True)
    worker = threading.Thread(target=lambda: model(torch.randn(2, 8)))
    worker.start()
    assert started.wait(CHILD_TIMEOUT_S)
    x = torch.randn(3, 8)
    pid = os.fork()
    if pid == 0:  # (the child: its own call, bounded by an alarm)
        try:
            import signal
            signal.alarm(int(CHILD_TIMEOUT_S))
            gate.set()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = ref(x)
            os._exit(0 if torch.equal(model(x).float(), want.float()) else 3)
        except BaseException:  # noqa: BLE001 - any failure is the exit code
            os._exit(4)
    gate.set()
    worker.join(CHILD_TIMEOUT_S)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # (-14: it hung until the alarm)
