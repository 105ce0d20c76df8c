"""Running a graph node by node: :class:`GraphRun`, the ``torch.fx.Interpreter`` every fxamp
pass, check and replay that runs a graph subclasses.

fx's interpreter hands a call the node's own argument containers (``immutable_list``,
``immutable_dict``), while the module fx generates builds fresh lists and dicts on every call.
A function that ``torch.fx.wrap`` keeps whole may mutate the lists it is given (torchvision's
``_get_window_and_shift_size`` writes into its ``window_size`` and ``shift_size``): under fx's
interpreter it fails, in the generated module it works. :class:`GraphRun` passes fresh plain
containers, as the generated code does, so a graph runs the same way in both.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx
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
