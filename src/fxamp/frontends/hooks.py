"""Module hooks survive the rewrite: hooked submodules stay calls, the root's hooks move over.

A traced graph calls no module's ``__call__``, so hooks registered on a module whose forward
is traced would be dropped (or, for a leaf such as ``nn.Linear`` made a functional call on
cast weights, skipped). fxamp keeps every submodule with a forward, forward-pre, backward or
backward-pre hook as one call in the graph, run under ``torch.autocast`` at run time
(``rule="runtime"``), so its hooks run exactly as in the original model under autocast — the
old-style ``weight_norm`` and ``spectral_norm`` (pre-hooks that recompute ``weight``) too.
The root's own hooks (and state-dict hooks) are registered on the rewritten module.
Module-level global hooks (``register_module_forward_hook`` ...) cannot be kept for the
traced ops, so they are refused.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Dict, Iterator, List

import torch.fx as fx
import torch.nn as nn
from torch.nn.modules import module as module_mod

from ..errors import UnsupportedModelError
from ..runtime import CALL_HOOK_DICTS, CALL_HOOKS, has_call_hooks  # noqa: F401 - re-exported

#: every hook dict of a module that the rewritten root takes over from the model's root: the
#: ones its call reads (``runtime.CALL_HOOK_DICTS``, which a rewritten child of an eager
#: root shares with the module it replaces, and a front end that calls the model takes off
#: the root while tracing) and its state-dict hooks
ROOT_HOOKS = CALL_HOOK_DICTS + ("_state_dict_hooks", "_state_dict_pre_hooks",
                                "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_GLOBAL = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
           "_global_backward_pre_hooks")


def hook_names(module: nn.Module) -> List[str]:
    """The hooks that run when ``module`` is called, as ``kind: function name``."""
    out = []
    for kind in CALL_HOOKS:
        for hook in (getattr(module, kind, None) or {}).values():
            out.append(f"{kind.strip('_').replace('_hooks', '_hook')}: {_name(hook)}")
    return out


def _name(hook: Any) -> str:
    inner = getattr(hook, "__func__", hook)
    return getattr(inner, "__qualname__", None) or type(inner).__qualname__


def check_global_hooks() -> None:
    """Refuse while global module hooks are registered: they would run for the modules the
    rewritten graph still calls but not for the ops traced out of the others."""
    found = [f"{kind.strip('_')}: {_name(hook)}" for kind in _GLOBAL
             for hook in getattr(module_mod, kind, {}).values()]
    if found:
        raise UnsupportedModelError(
            "global module hooks are registered (" + "; ".join(found) + "); a traced graph "
            "runs its ops without calling each module, so these hooks would stop running "
            "for most modules. what to do: remove them (handle.remove()) before amp_rewrite "
            "and register hooks on the rewritten model's modules instead")


def hooked_modules(model: nn.Module) -> Dict[str, List[str]]:
    """Submodule path -> its hooks, for every submodule (not the root) that has call hooks."""
    return {path: hook_names(m) for path, m in model.named_modules()
            if path and has_call_hooks(m)}


def without_root_hooks(model: nn.Module) -> Any:
    """The root's call hooks taken off while a front end that would run them (torch.export
    calls the model) traces it; ``copy_root_hooks`` puts them on the rewritten module."""
    return without_call_hooks([model])


@contextlib.contextmanager
def without_call_hooks(modules: "list[nn.Module] | Iterator[nn.Module]") -> Iterator[None]:
    """The call hooks of ``modules`` taken off for a while, and put back on every exit
    path: while the rewrite runs the model's code for what it learns from it (the eager
    front end's recorded calls), no hook of the user's runs (a counter, NEFTune's noise)."""
    saved = [(module, kind, getattr(module, kind)) for module in modules
             for kind in CALL_HOOK_DICTS if getattr(module, kind, None)]
    for module, kind, _ in saved:
        setattr(module, kind, collections.OrderedDict())
    try:
        yield
    finally:
        for module, kind, hooks in saved:
            setattr(module, kind, hooks)


def copy_root_hooks(model: nn.Module, gm: nn.Module) -> None:
    """Register the root's hooks (call hooks and state-dict hooks) on the rewritten module.
    The hooks receive the rewritten module as their ``module`` argument."""
    for kind in ROOT_HOOKS:
        hooks = getattr(model, kind, None)
        if hooks:
            mine = getattr(gm, kind)
            setattr(gm, kind, collections.OrderedDict(list(hooks.items())
                                                      + list(mine.items())))
    if getattr(model, "_is_full_backward_hook", None) is not None:
        gm._is_full_backward_hook = model._is_full_backward_hook


def mark_hooked_runtime(gm: fx.GraphModule) -> List[str]:
    """Make every call of a hooked submodule a runtime call (run under autocast at run
    time, hooks and all); return their paths."""
    from ..ops import module_label
    from .. import ir

    marked = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if has_call_hooks(module):
            ir.set(node, fixed=ir.Decision(
                None, ir.Rule.RUNTIME, "has hooks (" + ", ".join(hook_names(module)) + "): called "
                "as a module under torch.autocast at run time so they run as in the model",
                module_label(module), runtime=True))
            marked.append(str(node.target))
    return marked


def share_call_hooks(module: nn.Module, original: nn.Module) -> bool:
    """Make ``module`` (a rewritten child of an eager root, called as a module by the
    root's Python forward) hold ``original``'s call-hook dicts themselves, so that a hook
    registered on ``original`` after the rewrite (HF's NEFTune, ``enable_input_require_grads``)
    or removed from it runs, or stops running, when ``module`` is called. False (nothing
    shared) when ``module`` has hooks of its own that ``original`` lacks."""
    pairs = [(kind, getattr(module, kind, None), getattr(original, kind, None))
             for kind in CALL_HOOK_DICTS]
    if any(not isinstance(theirs, dict) or not isinstance(mine, dict)
           or not set(mine) <= set(theirs) for _, mine, theirs in pairs):
        return False
    for kind, _, theirs in pairs:
        module.__dict__[kind] = theirs
    return True
