"""Running a graph node by node: :class:`GraphRun`, the ``torch.fx.Interpreter`` every fxamp
pass, check and replay that runs a graph subclasses.

fx's interpreter hands a call the node's own argument containers (``immutable_list``,
``immutable_dict``), while the module fx generates builds fresh lists and dicts on every call.
A function that ``torch.fx.wrap`` keeps whole may mutate the lists it is given (torchvision's
``_get_window_and_shift_size`` writes into its ``window_size`` and ``shift_size``): under fx's
interpreter it fails, in the generated module it works. :class:`GraphRun` passes fresh plain
containers, as the generated code does, so a graph runs the same way in both.

Each run of a graph, or of a model's code, on example inputs gets its own copies of the
argument objects a call may change in place (:func:`own_copies`: a Hugging Face
``DynamicCache`` a layer appends its keys to), so one run's updates never reach the next
run or the caller.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.immutable_collections import immutable_dict, immutable_list


def plain(value: Any) -> Any:
    """``value`` with fx's immutable lists and dicts (at any depth, through tuples) made fresh
    plain ones; everything else is returned as it is.

    Args:
        value: a node's arguments with their values filled in.

    Returns:
        The same structure, each list and dict a new mutable one.
    """
    if isinstance(value, immutable_list):
        return [plain(v) for v in value]
    if isinstance(value, immutable_dict):
        return {k: plain(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(plain(v) for v in value)
    return value


class GraphRun(fx.Interpreter):
    """A ``torch.fx.Interpreter`` that gives each call fresh plain lists and dicts, as the
    module fx generates from the graph does (see the module docstring)."""

    def map_nodes_to_values(self, args: Any, n: fx.Node) -> Any:
        """fx's lookup of ``args``' values, with fresh plain containers (see :func:`plain`).

        Args:
            args: a node's ``args`` or ``kwargs``.
            n: the node they belong to (for fx's error message).

        Returns:
            ``args`` with each node replaced by its value.
        """
        return plain(super().map_nodes_to_values(args, n))

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """fx's run of the graph on its own copies of the argument objects a call may change
        in place (:func:`own_copies`): a run never changes the caller's (a KV cache), and
        the runs a pass makes on the same inputs each start from them as given.

        Args:
            *args: the graph's inputs.
            **kwargs: ``torch.fx.Interpreter.run``'s keywords.
        """
        return super().run(*own_copies(args), **kwargs)


def _is_state_object(value: Any) -> bool:
    """An argument object a forward may change in place: not a tensor, module, container
    or plain value (a Hugging Face ``DynamicCache`` a layer appends its keys to)."""
    return not isinstance(value, (torch.Tensor, nn.Module, str, bytes, int, float, bool,
                                  complex, type(None), torch.dtype, torch.device,
                                  torch.Size, tuple, list, dict, type)) \
        and hasattr(value, "__dict__") and not callable(value)


def _state_copy(value: Any, memo: Dict[int, Any]) -> Any:
    """A copy of an argument object's state for one run: objects and containers new,
    tensors detached copies (a static cache writes into its tensors in place; a cache's
    tensors from an earlier layer's forward are no leaves, which ``copy.deepcopy``
    refuses), modules, types and functions shared."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        out: Any = value.detach().clone()
    elif isinstance(value, dict):
        out = type(value)((k, _state_copy(v, memo)) for k, v in value.items())
    elif isinstance(value, list):
        out = [_state_copy(v, memo) for v in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        out = tuple(_state_copy(v, memo) for v in value)
    elif _is_state_object(value):
        out = copy.copy(value)
        memo[id(value)] = out
        out.__dict__.update((k, _state_copy(v, memo)) for k, v in vars(value).items())
    else:
        out = value
    memo[id(value)] = out
    return out


def own_copies(value: Any) -> Any:
    """``value`` with each argument object a forward may change in place
    (:func:`_is_state_object`) copied, inside tuples, lists and dicts; tensors and modules
    stay the caller's (a tensor inside such an object is copied with it). Each run of a
    model's code on the example inputs gets its own copies, so the caller's objects are
    left as they were and one run's updates (a KV cache's appended keys) do not reach the
    next."""
    if isinstance(value, dict):
        return type(value)((k, own_copies(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(own_copies(v) for v in value)
    if _is_state_object(value):
        return _state_copy(value, {})
    return value
