"""The ONNX stage's pass contract: the steps ``export_onnx`` runs on the exported file.

The fx passes (``fxamp.passes.manager``) work on a GraphModule and say whether they changed
it; the ONNX steps work on the exported ``ModelProto`` and count what they changed, and the
counts go into the file's ``metadata_props``. The contract is the same in shape: a declared
list of named steps (:data:`ONNX_STEPS`), each saying what it rewrites, with a condition,
run in order by one loop (:func:`run_onnx_steps`) that logs and returns the count of each.

The order matters (``docs/architecture.md``, "The ONNX stage"): the BatchNorm and constant
folds read the FP32 sources behind the weights' Casts (each folded weight rounded once), so
they run before ``weight_casts`` rounds the remaining weights; the optimizer runs between the
two constant folds; the repairs and the Cast pairs see the final graph.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List

from .cast_pairs import simplify_casts
from .constants import fold_constants
from .fold import fold_batchnorm
from .repairs import fix_eps, fold_weight_casts, repair_types, restore_tiny_adds

log = logging.getLogger(__name__)


@dataclasses.dataclass
class OnnxContext:
    """What the ONNX steps share: the model (a step may replace it), the exporter that made
    it ("dynamo" or "torchscript"), for the dynamo exporter its exported program, and the
    count of each step that ran, by name."""

    model: Any
    exporter: str
    program: Any = None
    counts: Dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OnnxStep:
    """One entry of the ONNX step list.

    ``run`` changes ``ctx.model`` (or replaces it) and returns how many things it changed;
    ``when``: run only if it returns True for the context; ``what``: what the step rewrites,
    one sentence (the architecture page's table)."""

    name: str
    run: Callable[[OnnxContext], int]
    what: str
    when: Callable[[OnnxContext], bool] = lambda ctx: True


def _dynamo(ctx: OnnxContext) -> bool:
    return ctx.exporter == "dynamo"


def _optimize(ctx: OnnxContext) -> int:
    """onnxscript's optimizer (the one ``torch.onnx.export`` runs by default); the count is
    how many nodes fewer the graph has."""
    import onnxscript.optimizer

    before = len(ctx.model.graph.node)
    ctx.model = onnxscript.optimizer.optimize(ctx.model)
    return before - len(ctx.model.graph.node)


ONNX_STEPS: List[OnnxStep] = [
    OnnxStep("batchnorm", lambda ctx: fold_batchnorm(ctx.model),
             "each inference BatchNormalization reading a Conv alone is folded into the Conv's "
             "weight and bias, computed in FP32 from the values behind the Casts, rounded "
             "once"),
    OnnxStep("constants", lambda ctx: fold_constants(ctx.model),
             "each constant subgraph (a weight's Transpose, a Conv's zero bias) becomes one "
             "initializer, computed from the FP32 sources, rounded once"),
    OnnxStep("optimize", _optimize, "onnxscript's optimizer: its fusions and no-op rules",
             when=_dynamo),
    OnnxStep("constants_again", lambda ctx: fold_constants(ctx.model),
             "the constant subgraphs the optimizer leaves, folded the same way", when=_dynamo),
    OnnxStep("weight_casts", lambda ctx: fold_weight_casts(ctx.model),
             "each Cast of an initializer becomes an initializer of the cast's type (the "
             "FP32 weight rounded once; onnxscript folds only up to 8192 elements)"),
    OnnxStep("eps_adds", lambda ctx: restore_tiny_adds(ctx.model, ctx.program),
             "an `x + eps` the optimizer deleted (it takes an eps under 1e-8 for 0) is put "
             "back",
             when=lambda ctx: ctx.program is not None),
    OnnxStep("types", lambda ctx: repair_types(ctx.model),
             "an FP32 initializer read by a node whose activation input is FP16 / BF16 is "
             "cast to that type"),
    OnnxStep("eps", lambda ctx: fix_eps(ctx.model),
             "an eps that is 0 in FP16 / BF16 becomes the smallest normal; an epsilon "
             "attribute of 0 becomes 1e-5"),
    OnnxStep("casts", lambda ctx: simplify_casts(ctx.model),
             "Casts that do nothing, cancel (a widening round trip) or repeat are removed"),
]


def run_onnx_steps(model: Any, exporter: str, program: Any = None) -> OnnxContext:
    """Run the ONNX steps in order on an exported model.

    Args:
        model: the exporter's ``ModelProto`` (changed in place; a step may replace it).
        exporter: the exporter that made it, ``"dynamo"`` or ``"torchscript"``.
        program: the dynamo exporter's ``ExportedProgram`` (None for TorchScript).

    Returns:
        The context: ``ctx.model`` is the final model; ``ctx.counts`` maps each step that
        ran to its count.
    """
    ctx = OnnxContext(model, exporter, program)
    for step in ONNX_STEPS:
        if not step.when(ctx):
            continue
        ctx.counts[step.name] = step.run(ctx)
        log.debug("ONNX step %s: %d", step.name, ctx.counts[step.name])
    return ctx
