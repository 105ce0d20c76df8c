"""Audit every graph of an fxamp result: a plain rewritten GraphModule, graphs nested in it
(untraceable submodules rewritten on their own) and the eager front end's results (a model
whose own forward stays Python, with its children rewritten).

The parts that run under ``torch.autocast`` at run time (rule ``runtime``: submodules no
front end takes) have no graph to read: each is listed as ``runs-under-autocast`` (info) and
its norm modules are checked from the modules themselves.

Finding codes added here:

* ``runs-under-autocast`` (info): a submodule that runs under torch.autocast at run time;
  the graph checks do not see inside it.
* ``output-low-precision`` (warning): the rewritten model returns fp16/bf16 tensors (policy
  ``output=keep`` / ``numerics=off``), so a loss computed outside the model on them runs in
  low precision (seed checkpoint 9).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from ..._torch import tree_leaves

from ...ops import module_label
from ...plan import Plan
from ...policy import Policy, dtype_name
from .graph import audit_graph
from .findings import Finding
from .numerics import eps_finding, module_eps
from ... import ir

log = logging.getLogger(__name__)


def _prefixed(findings: List[Finding], path: str) -> List[Finding]:
    """Findings of a nested graph, named as its plan lines are (``path/node``), their
    policy override hints too."""
    return [dataclasses.replace(f, node=f"{path}/{f.node}",
                                fix=f.fix.replace(f":{f.node}'", f":{path}/{f.node}'"))
            for f in findings]


def _runtime_part(path: str, module: nn.Module, policy: Policy) -> List[Finding]:
    """The finding for a part that runs under autocast, then its norm modules' eps."""
    out = [Finding(
        "info", "runs-under-autocast", path, "",
        f"{module_label(module)} is not traceable: it runs under torch.autocast "
        f"({dtype_name(policy.compute)}) at run time, so its ops' precisions are autocast's "
        "and the graph checks do not see inside it (its norm modules are checked)",
        "make its forward traceable (no Python control flow on tensor values) to get an "
        "explicit plan for it")]
    for name, sub in module.named_modules():
        found = module_eps(sub)
        if found is not None:
            where = f"{path}.{name}" if name else path
            finding = eps_finding(where, "", found[0], found[1], policy)
            if finding is not None:
                out.append(finding)
    return out


def _output_dtype(node: Any, plan: Plan) -> Optional[torch.dtype]:
    if not isinstance(node, fx.Node):
        return None
    if ir.is_cast(node):
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        return dtype if isinstance(dtype, torch.dtype) else None
    p = plan.nodes.get(node.name)
    return p.dtype if p is not None else None


def _check_outputs(gm: fx.GraphModule, plan: Plan) -> List[Finding]:
    """``output-low-precision`` for each output that leaves the graph in fp16/bf16."""
    out: List[Finding] = []
    for node in gm.graph.nodes:
        if node.op != "output":
            continue
        for value in tree_leaves(node.args):
            dtype = _output_dtype(value, plan)
            if dtype in (torch.float16, torch.bfloat16):
                out.append(Finding(
                    "warning", "output-low-precision", value.name, "",
                    f"the model returns {value.name} in {dtype_name(dtype)}: a loss "
                    "computed on it outside the model runs in low precision",
                    "keep the default policy output=fp32, or call .float() on the output "
                    "before the loss"))
    return out


def audit_result(gm: nn.Module, policy: Policy, top: bool = True) -> List[Finding]:
    """The findings of a model made by ``fxamp.amp_rewrite`` (any front end), nested graphs'
    node names prefixed with their module path (``backbone/conv2d``)."""
    from ...result import plan_of

    plan = plan_of(gm)
    findings: List[Finding] = []
    nested: Dict[str, str] = dict(item.split("=", 1) for item in
                                  plan.header.get("nested", "").split() if "=" in item)
    runtime = plan.header.get("runtime leaves", "").split()
    if isinstance(gm, fx.GraphModule):
        findings += audit_graph(gm, plan, policy)
        if top and policy.output_dtype != torch.float32:
            findings += _check_outputs(gm, plan)
    for path in nested:
        sub = gm.get_submodule(path)
        findings += _prefixed(audit_result(sub, policy, top=False), path)
    for path in runtime:
        try:
            module = gm.get_submodule(path)
        except AttributeError:
            continue
        findings += _runtime_part(path, module, policy)
    log.debug("audit of %s: %d findings", type(gm).__name__, len(findings))
    return findings
