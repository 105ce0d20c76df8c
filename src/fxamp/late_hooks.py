"""Hooks added after the rewrite to a submodule whose ops the graph runs without calling it.

A rewritten graph calls the submodules that had hooks at rewrite time (their hooks run,
added or removed later too); the others are traced into ops, so a hook registered on one of
them later would never run. The graph's first call (:func:`check`) looks at their hook
dicts (one C-level ``any`` over them, microseconds) and refuses, naming the module and the
hook, while such a hook is registered.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Tuple

import torch.fx as fx
import torch.nn as nn

from .errors import UnsupportedModelError

#: the hook dicts of a module that run when it is called
_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
ATTR = "fxamp_late_hooks"


class Watch:
    """The submodules one graph runs as ops (weakly held, by path) and their hook dicts."""

    def __init__(self, modules: List[Tuple[str, nn.Module]]) -> None:
        self.modules = [(path, weakref.ref(m)) for path, m in modules]
        self.dicts = [getattr(m, kind) for _, m in modules for kind in _KINDS
                      if isinstance(getattr(m, kind, None), dict)]

    def __getstate__(self) -> dict:  # (copies and pickles watch the copied modules)
        return {"modules": [(p, r()) for p, r in self.modules if r() is not None]}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["modules"])  # type: ignore[misc]

    def found(self) -> List[str]:
        """``path (kind: hook)`` for each hook now registered on a watched module."""
        out = []
        for path, ref in self.modules:
            module = ref()
            for kind in _KINDS if module is not None else ():
                for hook in getattr(module, kind, {}).values():
                    name = getattr(hook, "__qualname__", type(hook).__qualname__)
                    out.append(f"{path} ({kind.strip('_')[:-1]}: {name})")
        return out


def check(watch: Watch, *inputs: Any) -> None:
    """A graph's check, before its ops: refuse while a hook added after the rewrite is
    registered on a module the graph does not call. ``inputs`` keep the call first."""
    if not any(watch.dicts):
        return
    found = watch.found()
    if not found:  # (hook dicts replaced since: watch the ones the modules hold now)
        watch.__init__([(p, r()) for p, r in watch.modules if r() is not None])  # type: ignore[misc]
        return
    raise UnsupportedModelError(
        "hooks were registered after amp_rewrite on submodules whose ops the rewritten "
        f"graph runs without calling them, so they would not run: {'; '.join(found)}; what "
        "to do: register them before amp_rewrite (a submodule with hooks stays a call that "
        "runs them) and rewrite again, or remove them (handle.remove())")


def is_check(node: fx.Node) -> bool:
    """The graph's late-hook check (:func:`check`) or the read of its watch."""
    return (node.op == "call_function" and node.target is check) or (
        node.op == "get_attr" and node.target == ATTR)


def _attr(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def install(gm: fx.GraphModule, model: nn.Module) -> None:
    """Watch the submodules of ``model`` that ``gm``'s graph runs as ops (those named in its
    nodes' ``nn_module_stack`` that no ``call_module`` node calls), and make ``gm``'s first
    call check them."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module" or (
        n.op == "get_attr" and isinstance(_attr(gm, str(n.target)), nn.Module))}
    paths = set()
    for node in gm.graph.nodes:
        for value in (node.meta.get("nn_module_stack") or {}).values():
            path = value[0] if isinstance(value, tuple) else None
            if isinstance(path, str) and path and path not in called:
                paths.add(path)
    modules = []
    for path in sorted(paths):
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if any(path.startswith(c + ".") for c in called):
            continue  # inside a module the graph calls: its hooks run
        modules.append((path, module))
    if not modules:
        return
    gm.__dict__[ATTR] = Watch(modules)  # (a plain attribute: no module, parameter or buffer)
    graph = gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = inputs[-1] if inputs else next(iter(graph.nodes))
    with graph.inserting_after(anchor):
        node = graph.create_node("get_attr", ATTR)  # (fx warns of a non-module attribute)
    with graph.inserting_after(node):
        graph.call_function(check, (node, *inputs))
    gm.recompile()
