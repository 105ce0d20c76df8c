"""The front-end protocol: what a front end is given (:class:`Request`) and what it gives back
(a :class:`Traced` graph, or :class:`Children` for the layer above to rewrite and assemble).

Every front end is an object with

- ``name``: what the plan header's ``frontend`` records (``fx``, ``export``, ``fx+runtime``,
  ``eager``); ``config.FRONTEND_ORDER`` says which ones each ``frontend=`` value tries;
- ``fallback``: True for a front end that works around the failures of the ones tried
  before it (it reads their errors in ``request.errors``; its own failure is not listed in
  the "no front end takes" message);
- ``graph``: True when it gives one graph of the whole model (False: eager; a caller that
  needs a whole graph, such as calibration, the tolerance search or the audit, skips it);
- ``capture(model, request)``: a :class:`Traced` or :class:`Children`, or a ``TraceError``
  naming the line and the way out.

A graph front end (``graph`` True) also says how its graph is called (:class:`GraphFrontend`):
``inputs`` (the placeholder values for a call of the model), ``calibration`` (calibration
batches as the graph takes them), ``runtime_calls`` (graph calls kept as module calls run
under autocast, such as hooked modules) and ``finish`` (what the rewritten module needs to
be called like the model: pre-hooks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, NamedTuple, Optional,
                    Protocol, Tuple, Union)

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import TraceError
from .state import ModelState

if TYPE_CHECKING:
    from .calls import CallStructure


#: ``Request.dynamic_shapes`` asking torch.export for every dimension as the example has it
#: (a deployment plan's capture, the other-mode graph of a training plan)
STATIC_SHAPES = "static"


class Traced(NamedTuple):
    """A captured graph: the module, the front end that took it, its placeholder values
    and the submodules kept as runtime calls (each for the rewriter to try on its own)."""

    graph_module: fx.GraphModule
    frontend: str
    inputs: tuple
    leaves: List[str]

    @property
    def kind(self) -> str:
        """"graph": the rewriter runs the passes on ``graph_module``."""
        return "graph"


class Children(NamedTuple):
    """The eager front end's capture: the model's own forward stays Python; the rewriter
    rewrites each child in ``paths`` on its own, called as in ``calls`` (its first call on
    the example inputs: args, kwargs, output), and assembles them (``eager.eager_root``).
    ``refused`` is the error of the front ends tried before, raised when no child can be
    rewritten."""

    frontend: str
    paths: List[str]
    calls: Dict[str, Tuple[tuple, dict, Any]]
    refused: Optional[TraceError]

    @property
    def kind(self) -> str:
        """"children": the rewriter rewrites the children and assembles them."""
        return "children"


Capture = Union[Traced, Children]


@dataclass
class Request:
    """One capture of a model: the call (``args``, ``kwargs``), the ``frontend=`` the user
    asked for (it shapes the advice in errors), torch.export's ``dynamic_shapes``, the
    model's snapshot (restored after each front end that fails), the errors of the front
    ends tried so far, by name, and whether only the eval-mode graph is wanted."""

    args: tuple
    kwargs: Dict[str, Any]
    asked: str
    state: ModelState
    dynamic_shapes: Any = None
    errors: Dict[str, TraceError] = field(default_factory=dict)
    #: capture the eval-mode graph alone (a deployment plan: the file is for inference)
    inference: bool = False
    #: the plan's low dtype: values the code reads from tensors' dtypes follow autocast's
    #: run with it (torch.export front end, :mod:`.dtype_reads`); None: the FP32 trace's
    compute: Optional[torch.dtype] = None
    #: ``settled(node, key)``: an argument of the captured graph the plan does without, so
    #: autocast's value of it needs no export under autocast (:mod:`.dtype_reads`)
    settled: Optional[Callable[[fx.Node, Union[int, str]], bool]] = None
    #: submodule paths the trace keeps as module calls (``RewriteConfig.regions``)
    regions: Tuple[str, ...] = ()


class Frontend(Protocol):
    """A front end (see the module docstring)."""

    name: str
    fallback: bool
    graph: bool

    def capture(self, model: nn.Module, request: Request) -> Capture:
        """The graph (or the children) of ``model`` called as ``request`` says."""
        ...


class GraphFrontend(Frontend, Protocol):
    """A front end giving one graph of the whole model, and how that graph is called."""

    def inputs(self, model: nn.Module, traced: Traced, args: tuple,
               kwargs: Dict[str, Any]) -> tuple:
        """The placeholder values of ``traced``'s graph for ``model(*args, **kwargs)``."""
        ...

    def calibration(self, traced: Traced, batches: Iterable[Any]) -> Iterable[Any]:
        """Calibration batches (the model's positional inputs) as the graph takes them."""
        ...

    def runtime_calls(self, traced: Traced) -> List[str]:
        """Mark the graph's calls that must stay module calls run under autocast (hooked
        modules); their paths."""
        ...

    def finish(self, gm: fx.GraphModule, traced: Traced, model: nn.Module, args: tuple,
               kwargs: Dict[str, Any]) -> Optional["CallStructure"]:
        """Make the rewritten ``gm`` callable like ``model`` (pre-hooks); the call
        structure it checks on entry (``Rewritten.calls``), or None."""
        ...
