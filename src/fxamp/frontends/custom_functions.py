"""Custom ``torch.autograd.Function``s under torch.export: their backward would be lost.

Non-strict ``torch.export`` runs a custom Function's ``forward`` on fake tensors and records
the ATen ops inside it; its own ``backward`` is not part of the graph, so a model rewritten
from that graph would train with autograd's derivative of the forward's ops instead (Hugging
Face BLOOM's ``GeLUFunction`` computes its gradient with another formula). :func:`recording`
notes each such Function the model applies while it is exported; the export front end then
refuses the model by name (unless the rewrite is for inference, where no backward runs), so
``frontend="auto"`` moves on to a front end that keeps the Function's call.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from .._torch import patched
from ..errors import TraceError

#: (the Function class, the path of the module whose forward applied it; "" for the root)
Applied = Tuple[type, str]


def _is_users(cls: type) -> bool:
    """A Function of the model's code (torch's own, checkpointing's say, are handled
    elsewhere or have no backward of their own to lose)."""
    module = getattr(cls, "__module__", "") or ""
    return module != "torch" and not module.startswith("torch.")


def _caller_module(paths: Dict[int, str]) -> str:
    """The path of the innermost module of the model whose code is running."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            return paths[id(owner)]
        frame = frame.f_back
    return ""


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[List[Applied]]:
    """Within the block (on this thread), note each custom Function of the model's code
    applied with gradients on; yields the list they are appended to (each once)."""
    applied: List[Applied] = []
    paths: Dict[int, str] = {}

    def apply(original: Any, cls: type, *args: Any, **kwargs: Any) -> Any:
        if _is_users(cls) and torch.is_grad_enabled() and \
                all(cls is not seen for seen, _ in applied):
            if not paths:
                paths.update((id(m), name) for name, m in model.named_modules())
            applied.append((cls, _caller_module(paths)))
        return original(cls, *args, **kwargs)

    with patched("function_apply", apply):
        yield applied


def refusal(model: nn.Module, applied: List[Applied]) -> TraceError:
    """The TraceError for a model whose export inlined custom Functions; its ``plan_reason``
    is the plan's words for why another front end took the model."""
    cls, path = applied[0]
    where = f"{type(model).__name__}.{path}" if path else type(model).__name__
    more = f" (and {len(applied) - 1} more)" if len(applied) > 1 else ""
    name = f"{cls.__module__}.{cls.__qualname__}"
    err = TraceError(
        f"torch.export inlines the forward of the custom autograd Function {name} (applied "
        f"in {where}){more} and drops its own backward: the rewritten model would train "
        "with another gradient\n  what to do: frontend='auto' (the default) moves on to a "
        "front end that keeps the Function's call and its backward")
    err.plan_reason = (  # type: ignore[attr-defined]
        f"torch.fx cannot trace the model's forward, and torch.export would drop the "
        f"backward of the custom autograd Function {name}, applied in {where}")
    return err


def plan_reason(refused: Optional[TraceError]) -> Optional[str]:
    """Why the front ends before the one that took a model refused it, where the plan
    should say so (a custom Function's backward export would drop); else None."""
    causes = getattr(refused, "causes", None) or {"": refused}
    return next((e.plan_reason for e in causes.values() if hasattr(e, "plan_reason")),
                None)
