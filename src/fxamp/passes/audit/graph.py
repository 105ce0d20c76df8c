"""Audit: a check pass that changes nothing. It lists what in a model works against mixed
precision, each finding with the node, its source line, the numbers and what to do.

``fxamp.audit(model, example_inputs)`` (in ``rewriter/audit.py``, the layer above) rewrites
the model with :func:`fxamp.amp_rewrite` (so the decisions are exactly the rewrite's) and
hands the plan and the rewritten graph, whose nodes keep the source names, shapes and stack
traces, to ``audit_graph`` here, which does the reading. The front
end is the caller's choice (``frontend=``, as for amp_rewrite): on torch.export's ATen graphs
the checks read the ATen spellings (``aten.layer_norm`` / ``native_layer_norm`` / ... eps from
the op's schema, ``aten.exp``, ``aten.to.dtype`` / ``_to_copy`` casts). Nested graphs and the
eager front end's results are walked by :mod:`fxamp.passes.audit.results`; the optional
optimizer / GradScaler / batch / ONNX checks are in :mod:`fxamp.passes.audit.context`.
This module runs the graph checks; they live in :mod:`fxamp.passes.audit.checks` (dims,
casts, binary_cross_entropy) and :mod:`fxamp.passes.audit.numerics` (exp, norm eps), on the
``Finding`` and graph helpers of :mod:`fxamp.passes.audit.findings`.

Finding codes (stable):

* ``dims-not-multiple-of-8`` (info): a Linear / Conv / matmul computing in fp16/bf16 whose
  GEMM dims are not multiples of 8, so tensor cores run padded or not at all. Linear:
  in_features (K) and out_features (N); the rows (batch x tokens) come from the data and are
  not checked. Conv / ConvTranspose: in and out channels per group; depthwise convs (one input
  channel per group) are skipped, they are not tensor-core GEMMs anyway. matmul / mm / bmm /
  addmm / baddbmm: the inner dim K and the output columns N from the example inputs' shapes
  (not the rows M, usually the batch). einsum and attention kernels are not checked.
* ``explicit-cast`` (warning): ``.half()``, ``.bfloat16()``, ``.to(torch.float16)``,
  ``.to(dtype=torch.bfloat16)``, ``.type(torch.float16)``, ``.type('torch.HalfTensor')`` in
  the model.
* ``binary-cross-entropy`` (error for target cuda, whose autocast refuses it; warning for
  cpu): ``F.binary_cross_entropy`` / ``nn.BCELoss`` on probabilities.
* ``exp-without-max-shift`` (warning for fp16, info for bf16): ``exp`` of a matmul / bmm /
  einsum output (through scalar mul/div, masks, additive biases, views and casts) with no
  max (or logsumexp) subtracted on the way: exp passes fp16's max 65504 past 11.09.
* ``norm-eps-underflow`` (warning) / ``norm-eps-subnormal`` (info): a norm's eps below the
  low dtype's smallest normal (``torch.finfo(dtype).tiny``, fp16 6.1e-5): "underflow" when
  the eps rounds to 0 in that dtype (fp16: below 3e-8, e.g. 1e-12), "subnormal" otherwise
  (e.g. the default 1e-5: harmless while the kernel keeps eps in fp32, as autocast's and
  fxamp's do, but fp16 export may flush it to 0). Norm modules (BatchNorm, LayerNorm,
  GroupNorm, InstanceNorm, RMSNorm), ``F.*`` / ``torch.*`` norm functions with a numeric eps
  (their default when not given), and hand-written norms adding a literal eps before a
  ``sqrt`` / ``rsqrt``.

When the rewrite refuses the model because of a banned op (binary_cross_entropy with the
numerics passes off, target cuda), ``audit`` rewrites it again with an ``fp32:<node>``
override for each banned node, so the audit still runs and reports them. Any other
``FxampError`` (untraceable model, FP16 parameters ...) propagates.
"""
from __future__ import annotations

import logging
from typing import Iterable, List, Optional

import torch.fx as fx

from ... import ir
from ...plan import Plan
from ...policy import Policy
from .checks import check_bce, check_cast, check_dims
from .findings import SEVERITIES, Finding, op_names, summary
from .numerics import check_eps, check_exp, eps_finding, module_eps
from ..graph_parts import graph_parts

__all__ = ["Finding", "SEVERITIES", "audit_graph", "eps_finding", "module_eps", "summary"]

log = logging.getLogger(__name__)


def audit_graph(gm: fx.GraphModule, plan: Plan, policy: Policy) -> List[Finding]:
    """The findings of a graph rewritten by fxamp (or traced and annotated), in graph order.

    ``plan`` gives each source node's precision (``plan_of(gm)``); nodes fxamp inserted
    (casts) are skipped. Shapes come from the annotate meta, or from the tensors themselves.
    """
    findings: List[Finding] = []
    for part in graph_parts(gm):  # (checkpoint regions hold part of the nodes)
        for node in part.graph.nodes:
            if ir.is_cast(node) or node.op in ("placeholder", "output", "get_attr"):
                continue
            p = plan.nodes.get(node.name)
            names = op_names(node, part)
            checks: Iterable[Optional[Finding]] = (
                check_dims(node, p, names, part) if p is not None else None,
                check_cast(node),
                check_bce(node, names, policy, p.op if p is not None else ""),
                check_exp(node, part, policy),
                check_eps(node, part, policy),
            )
            findings.extend(f for f in checks if f is not None)
    log.debug("audit: %d findings", len(findings))
    return findings
