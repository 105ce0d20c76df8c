"""A rewrite changes nothing for the process's other threads, and two rewrites in two threads
give what each gives alone (``_torch.TRACE_PATCHES``: thread-aware patches under one trace
lock; nothing patched at import).

Each test forces the overlap: the model's forward, run by the rewriting thread while it
traces, stops at :func:`_pause` until the other thread has done its work (or a short
timeout passes, when fxamp's trace lock keeps the other thread out). Rounds are repeated.
"""
from __future__ import annotations

import copy
import gc
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn as nn

import fxamp

BF16 = dict(dtype=torch.bfloat16, target="cpu")
ROUNDS = 8

#: per thread: the events the next forward it runs waits on (set by the test), then cleared
_ARMED: Dict[int, Any] = {}


def _pause() -> None:
    """In forward: where the test armed this thread, run its rendezvous (once)."""
    action = _ARMED.pop(threading.get_ident(), None)
    if action is not None:
        action()


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Net(nn.Module):
    """Linear layers around a kept ``no_grad`` region and a custom Function (fx keeps both
    through patches)."""

    def __init__(self, function: bool = True) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.function = function

    def forward(self, x):
        _pause()
        h = self.lin1(x)
        with torch.no_grad():
            s = h.abs().mean()
        if self.function:
            h = Double.apply(h)
        return self.lin2(torch.relu(h) + s)


def _net(seed: int, function: bool = True) -> Net:
    torch.manual_seed(seed)
    return Net(function)


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _rewrite(model: nn.Module, frontend: str) -> nn.Module:
    return fxamp.amp_rewrite(model, (_x(),), fxamp.RewriteConfig.make(frontend=frontend, **BF16))


def _summary(gm: nn.Module) -> tuple:
    """What a rewrite gives: its plan text, its code, its output on a fixed input."""
    with torch.no_grad():
        out = gm(_x(1))
    return fxamp.plan_of(gm).to_text(), gm.code, out


def _patched_objects() -> Dict[str, Any]:
    """The objects a trace replaces (see ``_torch.TRACE_PATCHES``), as torch has them now."""
    import torch.amp.autocast_mode as autocast_mode
    import torch.fx.graph as fx_graph

    owners = [(fx_graph, "_format_target"), (nn.Module, "__setattr__"),
              (nn.Module, "__call__"), (nn.Module, "__getattr__"),
              (torch.autograd.Function, "apply"), (torch, "is_grad_enabled"),
              (torch._C, "_set_grad_enabled"), (autocast_mode.autocast, "__enter__"),
              (torch.autograd.grad_mode.inference_mode, "__enter__"), (sys, "stderr"),
              (torch.utils.checkpoint, "_checkpoint_impl"),
              (torch.backends.mha, "get_fastpath_enabled")]
    return {f"{getattr(o, '__name__', o)}.{a}": vars(o)[a] for o, a in owners}


def _run(threads: List[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a thread hangs"


class _Recorder:
    """A thread body that keeps its exception for the test to raise."""

    def __init__(self) -> None:
        self.errors: List[BaseException] = []

    def __call__(self, fn: Any) -> Any:
        def body() -> None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - re-raised by check()
                self.errors.append(err)
        return body

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_two_threads_rewriting_their_own_models_get_what_each_gets_alone(frontend):
    function = frontend == "fx"
    alone = [_summary(_rewrite(_net(seed, function), frontend)) for seed in (1, 2)]
    for _ in range(ROUNDS):
        before = _patched_objects()
        meet = threading.Barrier(2, timeout=0.3)  # both inside a trace (the lock: one only)
        got: List[Optional[tuple]] = [None, None]
        models = [_net(i + 1, function) for i in (0, 1)]  # (torch's RNG is process-wide)
        rec = _Recorder()

        def rewrite(i: int) -> None:
            def wait() -> None:
                try:
                    meet.wait()
                except threading.BrokenBarrierError:
                    pass
            _ARMED[threading.get_ident()] = wait
            got[i] = _summary(_rewrite(models[i], frontend))

        _run([threading.Thread(target=rec(lambda i=i: rewrite(i))) for i in (0, 1)])
        rec.check()
        for mine, ref in zip(got, alone):
            assert mine is not None
            assert mine[0] == ref[0] and mine[1] == ref[1]
            assert torch.equal(mine[2], ref[2])
        assert _patched_objects() == before


def _train(model: Net, steps: int, autocast: bool) -> List[Dict[str, torch.Tensor]]:
    """``steps`` SGD steps on ``model``; each step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(_x(10 + step)).float().pow(2).mean()
        loss.backward()
        grads.append({n: None if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()})
        opt.step()
    return grads


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_a_model_trains_unchanged_in_one_thread_while_another_rewrites_it(autocast):
    steps = 3
    reference = _train(_net(3), steps, autocast)
    for _ in range(ROUNDS):
        model = _net(3)
        tracing, trained = threading.Event(), threading.Event()
        got: List[Any] = []
        rec = _Recorder()

        def rewriter() -> None:
            def wait() -> None:  # inside the trace: let the trainer run its steps
                tracing.set()
                trained.wait(10)
            _ARMED[threading.get_ident()] = wait
            _rewrite(model, "fx")

        def trainer() -> None:
            try:
                assert tracing.wait(10)
                got.extend(_train(model, steps, autocast))
            finally:
                trained.set()

        _run([threading.Thread(target=rec(rewriter)), threading.Thread(target=rec(trainer))])
        rec.check()
        assert len(got) == steps
        for mine, ref in zip(got, reference):
            assert all(g is not None for g in mine.values()), "a step lost its gradients"
            assert all(torch.equal(mine[n], ref[n]) for n in ref)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("buf", torch.zeros(8))


def _other_threads_work(holder: Holder, x: torch.Tensor) -> Dict[str, Any]:
    """What the other thread does while a rewrite traces; what it saw."""
    seen: Dict[str, Any] = {"frozen": gc.get_freeze_count()}  # (no gc.freeze under it)
    w = holder.lin.weight.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen["autocast"] = holder.lin(x)
    with torch.no_grad():
        seen["no_grad_mode"] = torch.is_grad_enabled()
        seen["no_grad"] = x @ w
    seen["grad_after"] = torch.is_grad_enabled()
    with torch.inference_mode():
        seen["inference"] = holder.lin(x)
    holder.tag = "set"
    holder.buf = torch.ones(8)
    holder.lin2 = nn.Identity()
    seen["attrs"] = (holder.tag, holder.buf.tolist(), type(holder.lin2))
    return seen


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_another_threads_autocast_no_grad_inference_mode_and_setattr_work_during_a_rewrite(
        frontend):
    function = frontend == "fx"
    alone = _summary(_rewrite(_net(4, function), frontend))
    x = _x(5)
    holder = Holder()
    expected = _other_threads_work(copy.deepcopy(holder), x)
    for _ in range(ROUNDS):
        tracing, done = threading.Event(), threading.Event()
        got: List[Any] = []
        seen: Dict[str, Any] = {}
        model = _net(4, function)  # (torch's RNG is process-wide)
        rec = _Recorder()

        def rewriter() -> None:
            def wait() -> None:
                tracing.set()
                done.wait(10)
            _ARMED[threading.get_ident()] = wait
            got.append(_summary(_rewrite(model, frontend)))

        def other() -> None:
            try:
                assert tracing.wait(10)
                seen.update(_other_threads_work(copy.deepcopy(holder), x))
            finally:
                done.set()

        _run([threading.Thread(target=rec(rewriter)), threading.Thread(target=rec(other))])
        rec.check()
        assert seen["autocast"].dtype == torch.bfloat16
        assert torch.equal(seen["autocast"], expected["autocast"])
        assert seen["no_grad_mode"] is False and seen["grad_after"] is True
        assert not seen["no_grad"].requires_grad
        assert torch.equal(seen["no_grad"], expected["no_grad"])
        assert seen["inference"].is_inference()
        assert torch.equal(seen["inference"], expected["inference"])
        assert seen["attrs"] == expected["attrs"]
        assert seen["frozen"] == 0
        plan, code, out = got[0]
        assert plan == alone[0] and code == alone[1]  # no node from the other thread
        assert torch.equal(out, alone[2])


class Interrupted(nn.Module):
    """A forward that raises where the test says (KeyboardInterrupt: mid-trace)."""

    def __init__(self, error: type) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.error = error

    def forward(self, x):
        with torch.no_grad():
            x = x * 2
        raise self.error("stop")


def test_a_rewrite_leaves_torch_as_it_was_also_when_it_raises():
    from fxamp import _torch

    before = _patched_objects()
    stderr = sys.stderr
    _rewrite(_net(6), "fx")
    assert _patched_objects() == before and sys.stderr is stderr
    for error in (RuntimeError, KeyboardInterrupt):
        with pytest.raises((fxamp.FxampError, error)):
            fxamp.amp_rewrite(Interrupted(error), (_x(),),
                              fxamp.RewriteConfig.make(frontend="fx", **BF16))
        assert _patched_objects() == before and sys.stderr is stderr
        with pytest.raises((fxamp.FxampError, error)):
            fxamp.amp_rewrite(Interrupted(error), (_x(),),
                              fxamp.RewriteConfig.make(frontend="export", **BF16))
        assert _patched_objects() == before and sys.stderr is stderr
    assert not _torch.tracing_thread()
    assert {(p.owner(), p.attribute) for p in _torch.TRACE_PATCHES.values()} <= {
        (o, a) for o in (torch, torch._C, nn.Module, torch.autograd.Function, sys)
        for a in ("is_grad_enabled", "_set_grad_enabled", "__setattr__", "apply", "stderr")
    } | {(torch.amp.autocast_mode.autocast, "__enter__"),
         (torch.autograd.grad_mode.inference_mode, "__enter__"),
         (torch.fx.graph, "_format_target"), (torch.utils.checkpoint, "_checkpoint_impl"),
         (torch.backends.mha, "get_fastpath_enabled")}


_IMPORT_PROBE = """
import sys, torch, torch.fx.graph, torch.nn as nn, torch.utils.checkpoint
import torch.amp.autocast_mode as am
def objects():
    return [vars(torch.fx.graph)["_format_target"], vars(nn.Module)["__setattr__"],
            vars(torch.autograd.Function)["apply"], torch.is_grad_enabled,
            torch._C._set_grad_enabled, vars(am.autocast)["__enter__"],
            vars(torch.autograd.grad_mode.inference_mode)["__enter__"], sys.stderr,
            vars(torch.utils.checkpoint)["_checkpoint_impl"]]
before = objects()
import fxamp
after_import = objects()
fxamp.amp_rewrite(nn.Linear(4, 4), (torch.randn(2, 4),),
                  fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
after_rewrite = objects()
print([a is b for a, b in zip(before, after_import)],
      [a is b for a, b in zip(before, after_rewrite)])
"""


@pytest.mark.slow  # (a fresh interpreter importing torch)
def test_import_fxamp_patches_nothing():
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    assert out == str([True] * 9) + " " + str([True] * 9)
