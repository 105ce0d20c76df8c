"""The audit's findings and the graph helpers its checks share: a ``Finding`` (severity, code,
node, source line, message, fix), ``summary``, and reading a rewritten graph (the value
behind fxamp's casts, shapes, the module a node calls, the ATen op names it runs — asked of
``fxamp.ops``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ... import ir, ops, runtime
from ...errors import source_line
from .. import fetch_attr

SEVERITIES = ("error", "warning", "info")
LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Finding:
    """One audit finding; ``str(finding)`` is its one-line form.

    Attributes:
        severity: ``"error"``, ``"warning"`` or ``"info"``.
        code: a short stable id (``"norm-eps"``).
        node: the source node's name.
        source: the user's source line (``""`` when unknown).
        message: what is wrong, with the numbers.
        fix: what to do.
    """

    severity: str
    code: str
    node: str
    source: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{self.severity} {self.code} {self.node}: {self.message}{where} -> {self.fix}"


def summary(findings: Sequence[Finding]) -> str:
    """``"3 findings: 1 error, 2 warnings"`` (counts that are 0 are left out)."""
    n = len(findings)
    head = f"{n} finding{'' if n == 1 else 's'}"
    parts = []
    for severity in SEVERITIES:
        count = sum(1 for f in findings if f.severity == severity)
        if count:
            plural = "s" if count != 1 and severity != "info" else ""
            parts.append(f"{count} {severity}{plural}")
    return f"{head}: {', '.join(parts)}" if parts else head


# ---------------------------------------------------------------------------------------
# graph helpers
# ---------------------------------------------------------------------------------------
def origin(value: Any) -> Any:
    """``value`` with the casts fxamp inserted stripped off."""
    while isinstance(value, fx.Node) and ir.is_cast(value) and value.args:
        value = value.args[0]
    return value


def shape_of(value: Any, gm: nn.Module) -> Optional[Tuple[int, ...]]:
    """The shape of a node's (first floating) output, from the annotate meta or the tensor."""
    value = origin(value)
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if not isinstance(value, fx.Node):
        return None
    shape = ir.get(value).shape
    if shape is not None:
        return tuple(shape)
    if value.op == "get_attr":
        tensor = fetch_attr(gm, str(value.target))
        if isinstance(tensor, torch.Tensor):
            return tuple(tensor.shape)
    return None


def called_module(node: fx.Node, gm: nn.Module) -> Optional[nn.Module]:
    """The module a node calls: its target, or the module fxamp's rewrite passes to a helper."""
    module = ops.module_of(node, gm)
    if module is not None:
        return module
    if ops.is_call(node, (runtime.call_with_params, runtime.autocast_module)):
        ref = node.args[0] if node.args else None
        if isinstance(ref, fx.Node) and ref.op == "get_attr":
            found = fetch_attr(gm, str(ref.target))
            return found if isinstance(found, nn.Module) else None
    return None


def op_names(node: fx.Node, gm: nn.Module) -> Tuple[str, ...]:
    """The ATen ops a node runs ((): none, or opaque)."""
    if node.op == "call_function":
        module = called_module(node, gm)
        if module is not None:  # a module the rewrite calls through a runtime helper
            return ops.module_ops(module)
    if node.op not in ("call_module", "call_function", "call_method"):
        return ()
    try:
        _, names = ops.autocast_ops(node, gm)
    except Exception:  # noqa: BLE001 - an unusual target: nothing to check
        return ()
    return tuple(names or ())


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (position ``index`` in the node's call) of ``node`` (``ops.arg``)."""
    return ops.arg(node, name, index, default)


def finding(node: fx.Node, severity: str, code: str, message: str, fix: str) -> Finding:
    """A finding at ``node``, with its source line."""
    return Finding(severity, code, node.name, source_line(node), message, fix)


def number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a Python number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def is_call_node(node: Any) -> bool:
    """Whether ``node`` is an fx call of a function or a tensor method."""
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method")


def up8(n: int) -> int:
    """``n`` rounded up to a multiple of 8."""
    return -(-n // 8) * 8
