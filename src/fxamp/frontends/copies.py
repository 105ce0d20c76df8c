"""Rewritten modules that cannot be copied say so: ``copy.deepcopy`` or ``pickle`` of a
result that would fail inside torch (an exported graph's local objects, an eager root's
closures) raises an :class:`~fxamp.errors.UnsupportedModelError` saying what to do instead.
The refusal is an instance attribute (``__reduce_ex__`` / ``__deepcopy__``), so it also
stops the copy of a module that holds the result (an in-place rewritten model).

:func:`bound_to` copies a rewritten module for an identical block (the same plan on the
block's own weights); the copy of a graph shares the graph and its generated code."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict

import torch.fx as fx
import torch.nn as nn

from ..errors import UnsupportedModelError
from ..program import DEVICE_CHECKED
from ..result import has_result, result_of
from .hooks import CALL_HOOK_DICTS

_WHAT = ("what to do: copy or pickle the original FP32 model and rewrite the copy "
         "(amp_rewrite is deterministic), or save state_dict(), which loads into a rewrite "
         "of the same model")


def _refusal(how: str, module: nn.Module, frontend: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:  # (named by the model it was made from)
        source = has_result(module) and result_of(module).source or type(module).__name__
        name = source.rpartition(".")[2]
        raise UnsupportedModelError(
            f"{how} of the {frontend}-front-end rewrite of {name} is not supported (it holds "
            f"objects torch cannot {'copy' if how == 'deepcopy' else 'pickle'}); {_WHAT}")
    return refuse


def refuse_copies(module: nn.Module, frontend: str, deepcopy: bool = True) -> None:
    """Make ``pickle`` (and ``copy.deepcopy``, when ``deepcopy``) of ``module`` raise."""
    module.__dict__["__reduce_ex__"] = _refusal("pickling", module, frontend)
    if deepcopy:
        module.__dict__["__deepcopy__"] = _refusal("deepcopy", module, frontend)


def bound_to(gm: nn.Module, source: nn.Module, block: nn.Module) -> nn.Module:
    """A copy of ``gm`` (a rewritten graph of ``source``) reading ``block``'s modules,
    Parameters, buffers and call-hook dicts at the same paths instead: the same plan, no new
    trace.

    Args:
        gm: the rewritten module of ``source`` (one that can be deep-copied).
        source: the module it was planned for.
        block: an identical module (the same share key, ``rewriter/blocks.py``).
    """
    memo: Dict[int, Any] = {}
    if has_result(gm):  # (the plan is frozen: the copies share it, and warn once for it)
        plan = result_of(gm).plan
        memo[id(plan)] = plan
    theirs = dict(block.named_modules(remove_duplicate=False))
    for path, mine in source.named_modules(remove_duplicate=False):
        other = theirs[path]
        memo[id(mine)] = other
        for kind in ("_parameters", "_buffers"):
            for name, value in getattr(mine, kind).items():
                if value is not None:
                    memo[id(value)] = getattr(other, kind)[name]
        for kind in CALL_HOOK_DICTS:  # (an eager root's child holds its original's)
            hooks = mine.__dict__.get(kind)
            if hooks is not None and other.__dict__.get(kind) is not None:
                memo[id(hooks)] = other.__dict__[kind]
    return _copy(gm, memo)


def _copy(gm: nn.Module, memo: Dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(gm, memo)``, for a ``GraphModule`` without a new graph or new code:
    the copy is of ``gm``'s own class (a ``GraphModule``'s class holds its generated
    ``forward``) and holds the same graph, which no one changes once planned (a graph's
    deep copy holds the same node targets and constants too: only its nodes are new);
    its other state (submodules, Parameters, buffers, hook dicts, the rewrite's result)
    is copied through ``memo``, as a deep copy copies it. A ``GraphModule``'s deep copy
    generates and compiles the graph's code again: for HF decoder layers sharing one
    eager plan, that was most of a layer's copy (12 ms)."""
    if not isinstance(gm, fx.GraphModule) or "_graph" not in gm.__dict__:
        return copy.deepcopy(gm, memo)
    new = object.__new__(type(gm))
    memo[id(gm)] = new
    new.__dict__.update({name: value if name == "_graph" else copy.deepcopy(value, memo)
                         for name, value in gm.__dict__.items() if name not in _DROPPED})
    for hook in new.__dict__.get("_deepcopy_hooks", ()):
        hook(new)
    return new


#: what a ``GraphModule``'s deep copy leaves out of the copy: an instance ``forward`` (an
#: eager root's wrapper of its child, set up anew for the copy) and the note that the
#: first call's device was checked (the copy's weights are another block's)
_DROPPED = ("forward", DEVICE_CHECKED)
