"""Module and attribute names that torch.fx's code generator cannot spell.

``torch.fx.graph._format_target`` writes a path component that is not a Python identifier
as ``getattr(self, "NAME")`` without escaping, so a submodule named ``a"b`` (legal for
``nn.Module.add_module``) makes the generated ``forward`` a SyntaxError, and a backslash in a
name reads back as a different name. fxamp rewrites models with any submodule name, and the
GraphModules it returns must survive ``recompile()``, ``copy.deepcopy`` and pickling, so on
import it installs :func:`format_target`: the same code as torch's for every name torch
already spells correctly (identifiers and names without ``"`` or ``\\``), a correct string
literal for the others. It is installed only when torch's own function gets such a name
wrong, so a torch that fixes it keeps its own.
"""
from __future__ import annotations

import logging

import torch.fx.graph as fx_graph

log = logging.getLogger(__name__)

__all__ = ["format_target", "install"]

_PROBE = 'a"b\\c'


def format_target(base: str, target: str) -> str:
    """``base.a.b`` for a dotted ``target``; components that are not identifiers are
    spelled ``getattr(base, "...")`` with a correctly escaped string literal."""
    out = base
    for part in target.split("."):
        if part.isidentifier():
            out = f"{out}.{part}"
        elif '"' in part or "\\" in part or not part.isprintable():
            out = f"getattr({out}, {part!r})"
        else:
            out = f'getattr({out}, "{part}")'
    return out


def _spells_correctly(fn: object) -> bool:
    try:
        code = fn("self", _PROBE)  # type: ignore[operator]
        return bool(eval(code, {}, {"self": type("S", (), {_PROBE: 1})()}) == 1)
    except Exception:  # noqa: BLE001 - a SyntaxError is exactly what this probes for
        return False


def install() -> None:
    """Use :func:`format_target` in torch.fx code generation if torch's own is wrong."""
    current = getattr(fx_graph, "_format_target", None)
    if current is None or current is format_target or _spells_correctly(current):
        return
    fx_graph._format_target = format_target
    log.debug("torch.fx: installed fxamp's escaping _format_target")


install()
