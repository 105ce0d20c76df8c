"""A call whose structure (which arguments are tensors, None or left out, the keywords a
``**kwargs`` takes, and on the export front end the Python values the graph holds) differs
from the example's is refused by a returned module with one CallStructureError naming the
argument, what the example had and the example to give; in place it is planned on that call
and computes like autocast. A call of the example's structure in another form (by keyword,
positionally, a None default given or left out) computes like autocast on the model, on the
fx and export front ends and in place (fxamp/frontends/calls.py, rewriter/inplace.py)."""
from __future__ import annotations

import copy
import cProfile
import inspect
import pstats

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import CallStructureError

BF16 = torch.bfloat16
X = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
MASK = torch.rand(2, 3, generator=torch.Generator().manual_seed(1))
#: (front end, inplace)
MODES = [("fx", False), ("export", False), ("fx", True), ("export", True)]


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor = None) -> torch.Tensor:
        y = self.lin(x)
        if mask is not None:
            y = y * mask.unsqueeze(-1)
        return y


def _models():
    torch.manual_seed(0)
    ref = Masked()
    return ref, copy.deepcopy(ref)


def _rewrite(model, mode, args=(X,), kwargs=None):
    frontend, inplace = mode
    return fxamp.amp_rewrite(model, args,
                             fxamp.RewriteConfig.make(example_kwargs=kwargs, dtype=BF16,
                                                      target="cpu",
                                                      frontend=frontend), inplace=inplace)


def _autocast(ref, *args, **kwargs):
    with torch.autocast("cpu", dtype=BF16):
        return ref(*args, **kwargs)


#: the structures a call can differ from its example's in
STRUCTURES = pytest.mark.parametrize("example, call, had, got", [
    ({"mask": MASK}, ((X,), {}), "a tensor", "left out"),
    ({"mask": MASK}, ((X,), {"mask": None}), "a tensor", "None"),
    ({}, ((X, MASK), {}), "left out", "a tensor"),
    ({}, ((X,), {"mask": MASK}), "left out", "a tensor"),
    ({"mask": None}, ((X,), {"mask": MASK}), "None", "a tensor"),
], ids=["tensor-then-absent", "tensor-then-None", "absent-then-positional",
        "absent-then-keyword", "None-then-tensor"])


@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: m[0])
@STRUCTURES
def test_a_call_of_another_structure_is_refused_naming_the_argument(mode, example, call,
                                                                    had, got):
    _, model = _models()
    gm = _rewrite(model, mode, kwargs=example)
    args, kwargs = call
    with pytest.raises(CallStructureError) as err:
        gm(*args, **kwargs)
    text = str(err.value)
    assert f"called with 'mask' {got}" in text
    assert f"example had 'mask' {had}" in text
    assert "example_kwargs={'mask': " in text and "what to do" in text


@pytest.mark.parametrize("frontend", ["fx", "export"])
@STRUCTURES
def test_in_place_a_call_of_another_structure_is_planned_on_that_call(frontend, example, call,
                                                                       had, got):
    ref, model = _models()
    _rewrite(model, (frontend, True), kwargs=example)
    first = fxamp.rewritten(model)
    args, kwargs = call
    assert torch.equal(model(*args, **kwargs), _autocast(ref, *args, **kwargs))
    assert torch.equal(model(*args, **kwargs), _autocast(ref, *args, **kwargs))
    assert fxamp.rewritten(model) is first  # (the example's graph stays the first one)
    assert torch.equal(model(X, **example), _autocast(ref, X, **example))


class Kwargs(nn.Module):
    """A forward with ``**kwargs`` read by the loss, as HF models take num_items_in_batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        y = self.lin(x).float().pow(2).sum()
        n = kwargs.get("num_items_in_batch")
        return y / n if n is not None else y / x.numel()


@pytest.mark.skipif(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 11),
                    reason="torch.export of a tensor keyword a **kwargs takes needs torch 2.11+ "
                           "('Must provide a tree_name' on 2.10)")
@pytest.mark.parametrize("frontend", ["export"])  # (fx traces **kwargs as one proxy)
def test_a_keyword_a_var_keyword_takes_is_never_dropped(frontend):
    torch.manual_seed(0)
    ref = Kwargs()
    gm = fxamp.amp_rewrite(copy.deepcopy(ref), (X,),
                           fxamp.RewriteConfig.make(dtype=BF16, target="cpu", frontend=frontend))
    n = torch.tensor(7.0)
    with pytest.raises(CallStructureError, match="'num_items_in_batch' a tensor"):
        gm(X, num_items_in_batch=n)
    model = copy.deepcopy(ref)
    _rewrite(model, (frontend, True))
    assert torch.equal(model(X, num_items_in_batch=n), _autocast(ref, X, num_items_in_batch=n))
    assert torch.equal(model(X), _autocast(ref, X))


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if double else y


def test_export_a_python_value_other_than_the_examples_is_refused_or_planned():
    """torch.export holds the example's Python values as constants: another value is another
    structure (a returned module refuses it by name; in place it gets its own graph)."""
    torch.manual_seed(0)
    ref = Flagged()
    gm = fxamp.amp_rewrite(copy.deepcopy(ref), (X,),
                           fxamp.RewriteConfig.make(example_kwargs={"double": False}, dtype=BF16,
                                                    target="cpu",
                                                    frontend="export"))
    assert torch.equal(gm(X, double=False), _autocast(ref, X, double=False))
    with pytest.raises(CallStructureError, match="'double' = True"):
        gm(X, double=True)
    model = copy.deepcopy(ref)
    fxamp.amp_rewrite(model, (X,),
                      fxamp.RewriteConfig.make(example_kwargs={"double": False}, dtype=BF16,
                                               target="cpu",
                                               frontend="export"), inplace=True)
    for flag in (True, False, True):
        assert torch.equal(model(X, double=flag), _autocast(ref, X, double=flag))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}{'-inplace' * m[1]}")
@pytest.mark.parametrize("example, call", [
    ((), ((X,), {"mask": None})),  # the example's None default, given by keyword
    ((), ((X, None), {})),
    ({"mask": None}, ((X,), {})),  # None given in the example, left out in the call
    ({"mask": None}, ((X,), {"mask": None})),
    ({"mask": MASK}, ((X, MASK), {})),  # a keyword of the example, given positionally
    ({"mask": MASK}, ((X,), {"mask": MASK})),
], ids=["absent-None-keyword", "absent-None-positional", "None-absent", "None-None",
        "keyword-positional", "keyword-keyword"])
def test_a_call_of_the_examples_structure_computes_like_autocast(mode, example, call):
    ref, model = _models()
    gm = _rewrite(model, mode, kwargs=example or None)
    args, kwargs = call
    got = gm(*args, **kwargs)
    assert torch.equal(got, _autocast(ref, *args, **kwargs))
    assert torch.equal(gm(*args, **kwargs), got)  # (the second call: the remembered key)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_example_kwargs_none_is_traced_as_none_not_as_a_tensor(frontend):
    ref, model = _models()
    gm = _rewrite(model, (frontend, False), kwargs={"mask": None})
    assert "unsqueeze" not in gm.code
    assert torch.equal(gm(X), _autocast(ref, X))


def test_the_fx_graph_takes_the_models_own_argument_names():
    _, model = _models()
    gm = _rewrite(model, ("fx", False))
    assert list(inspect.signature(gm.forward).parameters) == ["x", "mask"]
    assert "mask_1 =" not in gm.code.split("\n", 3)[2]  # (the signature line)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_an_unknown_keyword_in_place_names_the_models_arguments_only(frontend):
    _, model = _models()
    _rewrite(model, (frontend, True))
    with pytest.raises(fxamp.FxampError) as err:
        model(X, maks=MASK)
    text = str(err.value)
    assert "maks" in text and "Masked.forward takes mask, x by keyword" in text
    assert "mask_1" not in text


def _calls(fn) -> int:
    fn()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return pstats.Stats(prof).total_calls


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_the_check_costs_at_most_two_python_calls_and_no_binding_once_a_form_is_seen(frontend):
    _, model = _models()
    gm = _rewrite(model, (frontend, False), kwargs={"mask": MASK})
    forms = (lambda: gm(X, mask=MASK), lambda: gm(X, MASK))  # (the example's; another)
    checked = [_calls(form) for form in forms]  # (another form: bound on its first call)
    result = gm.__dict__["fxamp_result"]
    gm.__dict__["fxamp_result"] = result.replace(calls=None)  # (the check off)
    assert all(c - _calls(form) <= 2 for c, form in zip(checked, forms))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_the_call_structure_check(how):
    import pickle

    _, model = _models()
    gm = _rewrite(model, ("fx", False), kwargs={"mask": MASK})
    other = copy.deepcopy(gm) if how == "deepcopy" else pickle.loads(pickle.dumps(gm))
    assert torch.equal(other(X, MASK), gm(X, MASK))
    with pytest.raises(CallStructureError, match="'mask' left out"):
        other(X)
