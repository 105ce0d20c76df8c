"""Node data for Google's Model Explorer: the plan drawn on the graph people already look at.

Model Explorer (``pip install ai-edge-model-explorer``, plus ``model-explorer-onnx`` for ONNX
files) draws a ``torch.export`` program or an ONNX file and overlays "node data": per node a
number and a background colour. fxamp writes:

* for the model (``fxamp show --format model-explorer``): the plan on the model's
  ``torch.export`` program (``model_explorer.visualize_pytorch(exported_program=...)``), node
  ids as Model Explorer's PyTorch adapter names them (the program's fx node names, graph id
  ``"graph"``);
* for the ONNX file (``fxamp export --model-explorer``): the planned and the actual precision
  per ONNX node (two node-data sets), node ids as ``model-explorer-onnx`` names them (node
  names; graph inputs, outputs and initializers as ``"[value] NAME"``).

The value is the precision's bit width (fp64 64, fp32 32, fp16 and bf16 16, int8 8; 0 for
nodes without a floating result) and the colour is fxamp's colour for the dtype (the same as
the HTML picture), so fp16 and bf16 are told apart by colour. Model Explorer's node data
holds numbers only, so rule and reason travel differently: a second node-data set gives each
node's rule as a number (the legend is its ``name``), and ``fxamp export`` writes each ONNX
node's rule and reason into the node's metadata (``fxamp.rule`` / ``fxamp.reason``), which
the ONNX adapter shows in the node's side panel. JSON only is written here: Model Explorer
itself is not needed to write it.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from .config import FRONTEND_ORDER
from .errors import FxampError
from .fileio import atomic_write_text
from .ir import Rule
from .plan import NodePrecision, Plan
from .policy import dtype_name
from .show import COLOURS

BITS = {"fp64": 64, "fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "-": 0}
#: the rule codes drawn: "-" (no plan line), each plan rule (fxamp.ir.Rule), "other"
RULES = ["-"] + [rule.value for rule in Rule] + ["other"]
PROGRAM_GRAPH = "graph"  # the graph id of Model Explorer's PyTorch ExportedProgram adapter
_NONE_COLOUR = COLOURS["-"]


def _result(dtype: str) -> Dict[str, Any]:
    return {"value": BITS.get(dtype, 0), "bgColor": COLOURS.get(dtype, _NONE_COLOUR)}


def _graph_data(name: str, results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    return {"name": name, "results": results, "showExpandedSummaryOnGroupNode": False}


def _rule_code(rule: str) -> int:
    return RULES.index(rule) if rule in RULES else RULES.index("other")


def _rule_legend() -> str:
    return "fxamp rule (" + ", ".join(f"{i}={r}" for i, r in enumerate(RULES)) + ")"


def _plan_entry(plan: Plan, node: Any, params: Dict[str, str]) -> Optional[NodePrecision]:
    """The plan line for an exported-program node: by name, or for a parameter/buffer
    placeholder by the get_attr node of the same target (fxamp names it target_with_underscores)."""
    entry = plan.nodes.get(node.name)
    if entry is None and node.name in params:
        entry = plan.nodes.get(params[node.name].replace(".", "_"))
    return entry


def program_node_data(exported_program: Any, plan: Plan) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(precision, rule) node data for ``exported_program`` (``torch.export.export`` of the
    model) from fxamp's ``plan`` of the same model, as JSON-ready dicts in Model Explorer's
    ModelNodeData layout ``{graph_id: GraphNodeData}``. Every node of the program has an
    entry; a node the plan does not cover (no floating result, the output) gets value 0."""
    sig = exported_program.graph_signature
    params = {**dict(sig.inputs_to_parameters), **dict(sig.inputs_to_buffers)}
    precision: Dict[str, Dict[str, Any]] = {}
    rules: Dict[str, Dict[str, Any]] = {}
    missing = []
    for node in exported_program.graph_module.graph.nodes:
        entry = _plan_entry(plan, node, params)
        if entry is None and node.op == "call_function" and getattr(
                node.meta.get("val"), "is_floating_point", lambda: False)():
            missing.append(node.name)
        dtype = dtype_name(entry.dtype) if entry is not None else "-"
        precision[node.name] = _result(dtype)
        rules[node.name] = {"value": _rule_code(entry.rule if entry is not None else "-")}
    if missing:
        raise FxampError(f"{len(missing)} floating-point node(s) of the exported program have no "
                         f"line in the plan ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}): the plan was not made on this "
                         "program's graph; what to do: plan with frontend='export' on the same "
                         "model and inputs the program was exported from")
    return ({PROGRAM_GRAPH: _graph_data("fxamp precision (bits; colour = dtype)", precision)},
            {PROGRAM_GRAPH: _graph_data(_rule_legend(), rules)})


def onnx_node_data(path: str, report: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(planned, actual) precision node data for the ONNX file at ``path`` from fxamp's
    precision report of it (``fxamp.export.precision_report``). Node ids as the
    ``model-explorer-onnx`` adapter makes them: node names, and ``"[value] NAME"`` for graph
    inputs, outputs and initializers (their own type)."""
    import onnx

    from .export.onnx_types import ONNX_FLOAT_NAMES

    model = onnx.load(path, load_external_data=False)
    graph_id = model.graph.name or "<main>"
    rows = {row.onnx_node: row for row in report.layers}
    planned: Dict[str, Dict[str, Any]] = {}
    actual: Dict[str, Dict[str, Any]] = {}
    for node in model.graph.node:
        row = rows.get(node.name)
        planned[node.name] = _result((row.planned if row else None) or "-")
        actual[node.name] = _result((row.actual or row.exported if row else None) or "-")
    names = {**ONNX_FLOAT_NAMES, 3: "int8"}
    values: List[Tuple[str, int]] = [
        (v.name, v.type.tensor_type.elem_type) for v in list(model.graph.input)
        + list(model.graph.output)] + [(t.name, t.data_type) for t in model.graph.initializer]
    for name, elem in values:
        key = f"[value] {name}"
        planned[key] = actual[key] = _result(names.get(elem, "-"))
    return ({graph_id: _graph_data("fxamp planned precision (bits; colour = dtype)", planned)},
            {graph_id: _graph_data(f"fxamp actual precision on {report.backend} (bits; "
                                   "colour = dtype)", actual)})


def annotate_onnx(path: str, report: Any) -> None:
    """Write each node's fxamp rule, reason, planned and actual precision into its ONNX
    metadata (``fxamp.rule``, ``fxamp.reason``, ``fxamp.planned``, ``fxamp.actual``): the
    ONNX adapter of Model Explorer shows them in the node's side panel."""
    import onnx

    from .export.onnx_metadata import set_meta
    from .fileio import atomic_write_bytes

    model = onnx.load(path)
    rows = {row.onnx_node: row for row in report.layers}
    plan = report_plan(model)
    for node in model.graph.node:
        row = rows.get(node.name)
        if row is None:
            continue
        entry = plan.nodes.get(row.fx_node) if plan is not None and row.fx_node else None
        if entry is not None:
            set_meta(node, "fxamp.rule", entry.rule)
            set_meta(node, "fxamp.reason", entry.reason)
        for key, value in (("fxamp.planned", row.planned), ("fxamp.actual", row.actual)):
            if value:
                set_meta(node, key, value)
    atomic_write_bytes(path, model.SerializeToString())


def report_plan(model: Any) -> Optional[Plan]:
    """The fxamp plan export_onnx stored in the ONNX model, if any."""
    for prop in model.metadata_props:
        if prop.key == "fxamp.plan":
            return Plan.from_text(prop.value)
    return None


def write_node_data(path: str, data: Dict[str, Any]) -> None:
    """Write one node-data JSON file (atomically) for Model Explorer's "Load node data"."""
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def write_program_node_data(model: Any, inputs: Any, output: str, frontend: str = "auto",
                            **rewrite: Any) -> List[str]:
    """Plan ``model`` with the export front end, export it with ``torch.export`` and write the
    precision node data to ``output`` and the rule node data next to it; returns the paths.
    ``rewrite``: the other ``RewriteConfig.make`` keywords (dtype, target, policy)."""
    import torch

    from .config import RewriteConfig
    from .result import plan_of
    from .rewriter import amp_rewrite

    if "export" not in FRONTEND_ORDER.get(frontend, ("export",)):  # fx alone
        raise FxampError("--format model-explorer draws the model's torch.export program, so "
                         "it needs the export front end's node names; what to do: drop "
                         "--frontend fx (or use --frontend export)")
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    gm = amp_rewrite(model, args, RewriteConfig.make(frontend="export", **rewrite))
    precision, rules = program_node_data(torch.export.export(model, args), plan_of(gm))
    rule_path = companion_path(output, "rule")
    write_node_data(output, precision)
    write_node_data(rule_path, rules)
    return [output, rule_path]


def write_onnx_node_data(onnx_path: str, report: Any, output: str) -> List[str]:
    """Planned node data to ``output``, actual next to it (``.actual.json``), and the rule,
    reason and precisions into the ONNX nodes' metadata; returns the JSON paths."""
    planned, actual = onnx_node_data(onnx_path, report)
    annotate_onnx(onnx_path, report)
    actual_path = companion_path(output, "actual")
    write_node_data(output, planned)
    write_node_data(actual_path, actual)
    return [output, actual_path]


def companion_path(path: str, suffix: str) -> str:
    """``graph.json`` -> ``graph.<suffix>.json``."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{suffix}.{ext}" if dot and ext == "json" else f"{path}.{suffix}.json"
