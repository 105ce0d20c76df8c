"""Rewritten modules that cannot be copied say so: ``copy.deepcopy`` or ``pickle`` of a
result that would fail inside torch (an exported graph's local objects, an eager root's
closures) raises an :class:`~fxamp.errors.UnsupportedModelError` saying what to do instead.
The refusal is an instance attribute (``__reduce_ex__`` / ``__deepcopy__``), so it also
stops the copy of a module that holds the result (an in-place rewritten model)."""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from ..errors import UnsupportedModelError

_WHAT = ("what to do: copy or pickle the original FP32 model and rewrite the copy "
         "(amp_rewrite is deterministic), or save state_dict(), which loads into a rewrite "
         "of the same model")


def _refusal(how: str, module: nn.Module, frontend: str) -> Callable[..., Any]:
    name = type(module).__name__

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(
            f"{how} of the {frontend}-front-end rewrite of {name} is not supported (it holds "
            f"objects torch cannot {'copy' if how == 'deepcopy' else 'pickle'}); {_WHAT}")
    return refuse


def refuse_copies(module: nn.Module, frontend: str, deepcopy: bool = True) -> None:
    """Make ``pickle`` (and ``copy.deepcopy``, when ``deepcopy``) of ``module`` raise."""
    module.__dict__["__reduce_ex__"] = _refusal("pickling", module, frontend)
    if deepcopy:
        module.__dict__["__deepcopy__"] = _refusal("deepcopy", module, frontend)
