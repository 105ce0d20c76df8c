"""Caches that make a rewrite faster must not change it: the norm-eps probe memo and the
garbage-collection scope of amp_rewrite (see passes/norm_eps.py, rewriter/gc_scope.py)."""
import gc

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.passes import norm_eps, observe
from fxamp.rewriter.gc_scope import young_objects_only


class TwoInstNorms(nn.Module):
    """Two identical conv -> InstanceNorm(eps=1e-12) layers (the fp16 kernel gives NaN on a
    constant input: probed and fenced) and a LayerNorm (probed, kept in fp16)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.n1 = nn.InstanceNorm2d(4, eps=1e-12)
        self.n2 = nn.InstanceNorm2d(4, eps=1e-12)
        self.ln = nn.LayerNorm(4, eps=1e-12)

    def forward(self, x):
        h = self.n2(self.c2(self.n1(self.c1(x))))
        return self.ln(h.mean((2, 3)))


def _counting_probes(monkeypatch):
    """Count the probes that really run a kernel (memo hits do not)."""
    ran = []
    make = norm_eps._module_probe

    def counting(module):
        probe = make(module)

        def run(x):
            ran.append(type(module).__name__)
            return probe(x)
        return run
    monkeypatch.setattr(norm_eps, "_module_probe", counting)
    return ran


def _plan(model, x, frontend):
    observe.CACHE.entries.clear()
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu",
                                                    frontend=frontend))
    return gm, fxamp.plan_of(gm)


def test_identical_norm_modules_are_probed_once(monkeypatch):
    norm_eps._PROBED.clear()
    ran = _counting_probes(monkeypatch)
    model, x = TwoInstNorms(), torch.zeros(2, 4, 4, 4)
    gm, plan = _plan(model, x, "fx")
    assert ran.count("InstanceNorm2d") == 1 and ran.count("LayerNorm") == 1
    for name in ("n1", "n2"):  # both fenced by the one probe's answer
        assert plan.nodes[name].rule == "norm_eps" and plan.nodes[name].dtype == torch.float32
    assert plan.nodes["ln"].rule == "autocast"
    assert torch.isfinite(gm(x)).all()
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()
    # another configuration (here another eps) is probed on its own
    model.n2.eps = 1e-11
    _plan(model, x, "fx")
    assert ran.count("InstanceNorm2d") == 2


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_plan_is_the_same_with_and_without_the_probe_memo(monkeypatch, frontend):
    torch.manual_seed(0)
    model, x = TwoInstNorms(), torch.randn(2, 4, 4, 4)
    norm_eps._PROBED.clear()
    cached = str(_plan(model, x, frontend)[1])
    again = str(_plan(model, x, frontend)[1])  # every probe answered by the memo
    monkeypatch.setattr(norm_eps, "_module_key", lambda module: None)
    monkeypatch.setattr(norm_eps, "_function_key", lambda fn, args, kwargs: None)
    norm_eps._PROBED.clear()
    uncached = str(_plan(model, x, frontend)[1])
    assert not norm_eps._PROBED  # nothing was memoized: each probe ran
    assert cached == again == uncached
    assert "norm_eps" in cached  # the probes decided something


def test_module_key_tells_training_mode_and_configuration_apart():
    a, b = nn.BatchNorm2d(4, eps=1e-7), nn.BatchNorm2d(4, eps=1e-7)
    assert norm_eps._module_key(a) == norm_eps._module_key(b)
    b.eval()
    assert norm_eps._module_key(a) != norm_eps._module_key(b)
    assert norm_eps._module_key(a) != norm_eps._module_key(nn.BatchNorm2d(4, eps=1e-8))
    assert norm_eps._module_key(a) != norm_eps._module_key(nn.BatchNorm2d(8, eps=1e-7))


class _Cycle:
    def __init__(self):
        self.me = self


_FRESH_PROCESS = r"""
import gc, threading, weakref
import torch, torch.nn as nn
import fxamp
from fxamp.rewriter.gc_scope import young_objects_only

class Cycle:
    def __init__(self):
        self.me = self

assert gc.get_freeze_count() == 0 and threading.active_count() == 1
with young_objects_only():
    frozen = gc.get_freeze_count()
    assert frozen > 0, "the objects that existed are in the permanent generation"
    with young_objects_only():  # nested: the outer one keeps its freeze (the count may
        # only drop, by frozen objects freed meanwhile: nothing more is frozen)
        assert 0 < gc.get_freeze_count() <= frozen
    ref = weakref.ref(Cycle())  # garbage made inside the block
    gc.collect()
    assert ref() is None, "garbage made inside the block is collected"
assert gc.get_freeze_count() == 0, "unfrozen after the block"
fxamp.amp_rewrite(nn.Linear(4, 4), (torch.randn(2, 4),),
                  fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
assert gc.get_freeze_count() == 0, "amp_rewrite froze and unfroze"
print("ok")
"""


def test_gc_scope_collects_new_garbage_and_unfreezes():
    # a fresh interpreter: a thread an earlier test left running would turn the scope off
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_gc_scope_stands_aside_while_another_thread_runs():
    import threading
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="a-user-thread")
    other.start()
    try:
        before = gc.get_freeze_count()
        with young_objects_only():  # nothing frozen: freezing would hold back its garbage
            assert gc.get_freeze_count() <= before
    finally:
        stop.set()
        other.join()


@pytest.mark.slow
def test_gc_scope_leaves_a_programs_own_freeze_alone():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        # (the count may only drop, by frozen objects freed meanwhile: the program's freeze
        # is neither undone nor extended)
        with young_objects_only():
            assert 0 < gc.get_freeze_count() <= count
        assert 0 < gc.get_freeze_count() <= count
    finally:
        gc.unfreeze()
