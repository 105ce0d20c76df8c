"""The other training mode of a returned module, planned on its first call in it.

A model whose graph differs in train and eval mode beyond reads of ``training`` (timm's
``BatchNormAct2d``, an exported graph's batch-norm ops, a dropout whose kind the mode picks)
gets a graph for the mode it was rewritten in only (``Rewritten.mode``). In place, the first
call in the other mode is planned on that call (``rewriter/inplace.py``). A returned module
does the same through :class:`OtherMode`, kept in its result (``Rewritten.other_mode``): on
its first call in the other mode, the FP32 model it was made from is planned in that mode,
on that call's arguments (a shadow of the model is set to the mode, so neither the model
nor the returned module changes), and the call and the later ones in that mode run that
graph. It shares the model's Parameters, buffers and modules, as the first graph does, so a
train-then-validate loop reads one set of weights and batch-norm statistics.

The per-call cost is one attribute read on the mode check the Program makes anyway
(:mod:`fxamp.program`) and, in the other mode, one dict lookup.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional

import torch.nn as nn

from ..config import RewriteConfig

log = logging.getLogger(__name__)

#: plans ``model`` in ``mode`` on a call's ``(args, kwargs)`` with ``config`` and returns the
#: rewritten module (``pipeline._plan_mode``)
Planner = Callable[[nn.Module, bool, tuple, Dict[str, Any], RewriteConfig], nn.Module]


class OtherMode:
    """A returned module's graph for the mode it was not rewritten in, planned on its first
    call in that mode (see the module docstring).

    Args:
        model: the FP32 model the returned module was made from (the module's structure
            check holds it too).
        config: the rewrite's config (its target resolved).
        plan: the planner (``pipeline._plan_mode``).
    """

    def __init__(self, model: nn.Module, config: RewriteConfig, plan: Planner) -> None:
        self.model = model
        self.config = config
        self.plan = plan
        self.graphs: Dict[bool, nn.Module] = {}
        self.lock = threading.Lock()

    def __call__(self, program: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """Run the call (of ``program``, in the mode it was not traced for) on that mode's
        graph, planned first on this call when there is none yet.

        Args:
            program: the returned module being called.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
        """
        mode = program.training
        graph = self.graphs.get(mode)
        if graph is None:
            graph = self._planned(program, mode, args, kwargs)
        return graph(*args, **kwargs)

    def _planned(self, program: nn.Module, mode: bool, args: tuple,
                 kwargs: Dict[str, Any]) -> nn.Module:
        with self.lock:  # (one plan per mode: another thread's call waits for it)
            graph = self.graphs.get(mode)
            if graph is not None:
                return graph
            log.info("%s: planning its %s-mode graph on this call (it was rewritten in the "
                     "other mode, which traces differently)", type(self.model).__name__,
                     "train" if mode else "eval")
            graph = self.plan(self.model, mode, args, kwargs, self.config)
            graph.train(mode)  # (its own flag: only calls in this mode reach it)
            self.graphs[mode] = graph
            return graph

    def graph(self, mode: bool) -> Optional[nn.Module]:
        """The graph planned for ``mode``, or None before its first call.

        Args:
            mode: True for train, False for eval.
        """
        return self.graphs.get(mode)

    def __getstate__(self) -> Dict[str, Any]:
        """Copied and pickled without the lock; the graphs are planned again on a call."""
        state = dict(self.__dict__)
        state.pop("lock")
        state["graphs"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()
