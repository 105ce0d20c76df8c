"""fxamp's autocast tables against the installed torch: kernels present, categories observed."""
import pytest
import torch
import torch.nn as nn

import fxamp
from autocast_truth import autocast_category_probes, record_autocast_dtypes, autocast_rewrite
from fxamp import oplists


KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _aten_ops_with_autocast_kernel(target):
    names = [s[len("aten::"):] for s in torch._C._dispatch_get_all_op_names()
             if s.startswith("aten::")]
    return {n for n in names
            if torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + n, KEYS[target])}


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_tables_name_exactly_the_ops_with_an_autocast_kernel(target):
    """Every op torch registers an autocast kernel for is in the table, and nothing else.

    The tables copy the torch the project is developed on (they explain; autocast observed
    decides), so this runs on that torch only, not in the floor job."""
    kernels = _aten_ops_with_autocast_kernel(target)
    table = set(oplists.ATEN_TABLES[target])
    assert sorted(kernels - table) == [], "ops autocast handles that fxamp's table lacks"
    assert sorted(table - kernels) == [], "ops in fxamp's table that autocast does not handle"


@pytest.mark.floor
def test_every_torch_level_op_names_a_known_aten_op():
    """The torch-level maps only name ATen ops that exist in some table (no typos)."""
    known = set(oplists.ATEN_TABLES["cpu"]) | set(oplists.ATEN_TABLES["cuda"])
    known_bases = {k.split(".")[0] for k in known}
    used = set()
    for ops in list(oplists.MODULE_OPS.values()) + list(oplists.FUNCTION_OPS.values()) + \
            list(oplists.METHOD_OPS.values()):
        used.update(ops)
    unknown = sorted(op for op in used if op not in known and op.split(".")[0] not in known_bases)
    assert unknown == []


class _Wrap(nn.Module):
    def __init__(self, fn, n):
        super().__init__()
        self.fn, self.n = fn, n

    def forward(self, a, b, c):
        return self.fn(*(a, b, c)[: self.n])


def _inputs(probe, dtype, mixed):
    args = list(probe.make_inputs(dtype))
    if mixed:  # first floating input stays fp32, the rest in the low dtype
        first = next(i for i, a in enumerate(args) if a.is_floating_point())
        args[first] = args[first].float()
    return args


PROBES = autocast_category_probes()


@pytest.mark.floor  # also run on the oldest supported torch (.ci/run)
@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(PROBES))
def test_plan_matches_autocast_for_each_probe(name, dtype, target):
    """For fp32, low and mixed inputs, every node's planned dtype is autocast's real one."""
    probe = PROBES[name]
    variants = [(torch.float32, False), (dtype, False)] + ([(dtype, True)] if probe.mixed else [])
    for in_dtype, mixed in variants:
        args = _inputs(probe, in_dtype, mixed)
        n = len(args)
        model = _Wrap(probe.fn, n)
        full = tuple(args) + (None,) * (3 - n)
        try:
            truth = record_autocast_dtypes(torch.fx.symbolic_trace(model), full, target, dtype)
        except RuntimeError:
            # autocast itself refuses these inputs (e.g. CPU layer_norm of an fp32 input with
            # low-precision weights): fxamp refuses at rewrite time or the rewritten model
            # fails the same way; it never invents numerics autocast does not have.
            try:
                gm = autocast_rewrite(model, full, dtype=dtype, target=target)
            except fxamp.FxampError as err:
                assert "what to do" in str(err)
            else:
                with pytest.raises(RuntimeError):
                    gm(*full)
            continue
        gm = autocast_rewrite(model, full, dtype=dtype, target=target)
        plan = fxamp.plan_of(gm)
        got = {k: plan.nodes[k].dtype for k in truth}
        assert got == truth, f"{name} with {in_dtype} inputs (mixed={mixed})"
