"""``amp_rewrite(model, ..., inplace=True)``: the user's model itself computes with the plan.

The rewritten module (``gm``) shares the model's Parameters, buffers and leaf modules. With
``inplace=True`` it is kept in the model's ``__dict__`` (not as a submodule: the model's
``state_dict`` keys, ``parameters()`` and ``named_modules()`` stay as they were) and the
model's ``forward`` becomes a call of it. The model stays the same object of the same
class, so its other methods (``generate``, ``save_pretrained``, ``config``), the wrappers
around it (PEFT, Lightning, accelerate, DDP) and its hooks keep working; its own hooks run
once, around the rewritten forward. The graph reads the model's own modules, Parameters,
buffers and training flags (``fxamp/structure.py``): ``model.train()`` / ``model.eval()``,
``model.to(device)``, ``load_state_dict(assign=True)`` and a Parameter set on a module reach
it with no per-call copy. A change of the model's structure after the rewrite (a submodule
replaced or deleted, a parametrization, a patched ``forward``, ``.double()``) is seen at the
next call, which plans the model again on its inputs (logged as a warning) and computes with
the new plan; a change fxamp refuses (``.half()``: FP32 master weights) raises naming it.
``fxamp.plan_of(model)`` and ``fxamp.config_of(model)`` read the plan and config;
``fxamp.rewritten(model)`` returns the rewritten module.
"""
from __future__ import annotations

import inspect
import contextlib
import operator
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch.nn as nn

from ..errors import FxampError, UnsupportedModelError
from ..result import ATTR as RESULT, has_result, result_of
from ..structure import StructureChanged, mirrors

#: where the rewritten module lives in the model's ``__dict__``
ATTR = "_fxamp_rewritten"
#: the result attributes the model gets too (plan_of, config_of read them)
RESULT_ATTRS = (RESULT,)


def _check_sharding(model: nn.Module, cls: type) -> None:
    """After ``fully_shard`` of the model's root (its class swapped): the root's hooks
    gather every parameter before the forward, which then computes with them; sharded
    submodules would gather theirs in hooks the rewritten graph never calls: refused."""
    sharded = [path for path, m in model.named_modules() if path and is_fully_sharded(m)]
    if is_fully_sharded(model) and not sharded:
        return
    raise UnsupportedModelError(
        f"{cls.__name__} became a {type(model).__name__} after its in-place rewrite"
        + (f", and fully_shard was applied to its submodules ({', '.join(sharded[:3])})"
           if sharded else " (a wrapper swapped its class)")
        + ": the rewritten graph does not call the submodules' hooks. what to do: rewrite "
        "in place, then fully_shard(model) on the root alone (one FSDP2 group); or use "
        "FSDP2's own MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32) instead of fxamp")


_TRAINING = operator.attrgetter("training")
#: re-plans an in-place rewritten model whose structure changed: (model, args, kwargs, why)
#: -> the new rewritten module (set by the pipeline, which owns amp_rewrite)
Replan = Callable[[nn.Module, tuple, dict, str], nn.Module]


class InplaceForward:
    """The model's ``forward`` after an in-place rewrite: the rewritten module computes (its
    own call checks the model's structure, see ``fxamp/program.py``); when the model's
    structure changed since (a submodule replaced, a parametrization, a patched forward), the
    model is planned again on this call's inputs and computes with the new plan. Holds the
    model (deepcopy and pickling carry it to the copy through their memo)."""

    def __init__(self, model: nn.Module, names: Optional[FrozenSet[str]],
                 replan: Optional[Replan] = None,
                 pairs: Optional[List[Tuple[nn.Module, nn.Module]]] = None) -> None:
        self.model = model
        self.names = names  # the keyword arguments the model's forward takes (None: any)
        self.cls = type(model)
        self.replan = replan
        # a rewritten module without a structure check of its own (an eager root): its
        # modules take the training flags of the model's at the same paths when they change
        self.pairs = pairs or []
        self.theirs = [theirs for _, theirs in self.pairs]
        self.flags = tuple(map(_TRAINING, self.theirs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if type(model) is not self.cls:
            _check_sharding(model, self.cls)
            self.cls = type(model)
        if self.names is not None and not self.names.issuperset(kwargs):
            unseen = sorted(set(kwargs) - self.names)
            raise FxampError(
                f"{type(model).__name__} was called with keyword arguments its forward "
                f"does not take: {', '.join(unseen)} ({self.cls.__name__}.forward takes "
                f"{', '.join(sorted(self.names)) or 'none'} by keyword); what to do: call "
                "it with the forward's own argument names")
        if self.theirs:
            flags = tuple(map(_TRAINING, self.theirs))
            if flags != self.flags:
                for mine, theirs in self.pairs:
                    mine.training = theirs.training
                self.flags = flags
        try:
            return model.__dict__[ATTR](*args, **kwargs)
        except StructureChanged as err:
            if not err.replan or self.replan is None:
                raise
            gm = self.replan(model, args, kwargs, str(err))
        return gm(*args, **kwargs)


def _keywords(forward: Callable[..., Any]) -> Optional[FrozenSet[str]]:
    """The names ``forward`` takes as keywords (None when it takes any). The model's own:
    the rewritten module checks a call's structure against its example itself."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def install(model: nn.Module, gm: nn.Module, replan: Optional[Replan] = None) -> nn.Module:
    """Make ``model`` compute with ``gm`` (see the module docstring); returns ``model``."""
    if "forward" in model.__dict__:
        raise FxampError(
            f"{type(model).__name__} has a forward of its own set on the instance "
            f"({model.__dict__['forward']!r}); inplace=True replaces it. what to do: "
            "rewrite with inplace=False and use the returned module")
    for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"):
        theirs = getattr(model, kind, None)
        mine = getattr(gm, kind, None)
        if theirs and mine:  # the root's hooks run on the model itself, not twice
            for key in list(theirs):
                mine.pop(key, None)
    names = _keywords(model.forward)
    model.__dict__[ATTR] = gm
    structure = getattr(result_of(gm), "structure", None) if has_result(gm) else None
    forward = InplaceForward(model, names, replan,
                             None if structure is not None
                             else [(mine, theirs) for _, mine, theirs in mirrors(gm, model)])
    try:  # what inspect.signature(model.forward) tells a caller (HF Trainer reads it)
        forward.__signature__ = inspect.signature(gm.forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    model.__dict__["forward"] = forward
    for attr in RESULT_ATTRS:
        if hasattr(gm, attr):
            model.__dict__[attr] = getattr(gm, attr)
    if structure is not None:
        structure.inplace = True  # (the model's flags are the graph's)
        structure.take()  # (the model as it is now: its forward the rewritten one)
    return model


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``module`` (it swaps in a class that
    derives from ``FSDPModule``)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "FSDPModule" and cls.__module__.startswith("torch.distributed"):
            return True
    return False


def is_inplace(model: nn.Module) -> bool:
    """Whether ``model`` computes with an in-place rewrite."""
    return ATTR in model.__dict__


def _take(model: nn.Module) -> Dict[str, Any]:
    keys = (ATTR, "forward") + RESULT_ATTRS
    return {k: model.__dict__.pop(k) for k in keys if k in model.__dict__}


@contextlib.contextmanager
def uninstalled(model: nn.Module) -> Iterator[None]:
    """``model`` with its own forward back for a while (another rewrite of it: healing,
    the search, a new policy); the in-place rewrite is put back after."""
    taken = _take(model)
    try:
        yield
    finally:
        model.__dict__.update(taken)


def reinstall(model: nn.Module, gm: nn.Module, replan: Optional[Replan] = None) -> nn.Module:
    """Replace the in-place rewrite ``model`` computes with by ``gm``."""
    _take(model)
    return install(model, gm, replan)


def rewritten(model: nn.Module) -> nn.Module:
    """The rewritten module an in-place rewrite put inside ``model`` (``model`` itself
    when it is a rewritten module already)."""
    gm = model.__dict__.get(ATTR)
    if gm is not None:
        return gm
    if has_result(model):
        return model
    raise FxampError(f"{type(model).__name__} was not rewritten by fxamp.amp_rewrite; what "
                     "to do: call fxamp.amp_rewrite(model, example_inputs, inplace=True)")
