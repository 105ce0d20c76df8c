"""Pictures of a rewritten graph by precision: a self-contained HTML page, Graphviz DOT, Mermaid.

Nodes are coloured by the dtype they compute in, casts are marked, each node's rule and reason
show on hover. The HTML page groups nodes by module in collapsible sections, so graphs of
thousands of nodes stay usable; a drawn graph is added when the graph is small.
"""
from __future__ import annotations

import html
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from .passes import fetch_attr
from . import ir
from .ir import Rule
from .plan import Plan
from .result import has_result, result_of
from .policy import dtype_name

COLOURS = {"fp16": "#f5a623", "bf16": "#e8743b", "fp32": "#4a90d9", "fp64": "#7b5ea7",
           "-": "#c8c8c8"}
DRAW_LIMIT = 400  # draw the graph itself up to this many nodes


@dataclass
class ShownNode:
    """One node of the picture."""

    name: str
    op: str
    module: str
    dtype: str
    rule: str
    reason: str
    cast: bool
    inputs: List[str]


def _eager_nodes(model: torch.nn.Module, plan: Plan) -> List[ShownNode]:
    """The eager front end's result (its own forward is Python, so it has no graph): each
    rewritten child's graph, its nodes named ``child/node``, and each child that runs under
    torch.autocast at run time as one node (rule ``runtime``). Nothing links the children:
    the Python forward that calls them is not a graph."""
    out: List[ShownNode] = []
    for name, p in plan.nodes.items():
        if "/" in name:
            continue
        sub = getattr(model, name, None)
        sub_plan = result_of(sub).plan if has_result(sub) else None
        if p.rule == "nested" and isinstance(sub_plan, Plan):
            for n in shown_nodes(sub, sub_plan):
                module = f"{name}.{n.module}" if n.module else name
                out.append(ShownNode(f"{name}/{n.name}", n.op, module, n.dtype, n.rule,
                                     n.reason, n.cast, [f"{name}/{i}" for i in n.inputs]))
            continue
        out.append(ShownNode(name, p.op, p.module or name, dtype_name(p.dtype), p.rule,
                             p.reason, False, []))
    return out


def shown_nodes(gm: fx.GraphModule, plan: Plan) -> List[ShownNode]:
    """The nodes of the rewritten graph (casts included) with their plan entries; for the
    eager front end's result, the nodes of its rewritten children (see ``_eager_nodes``)."""
    if not isinstance(gm, fx.GraphModule):
        return _eager_nodes(gm, plan)
    out: List[ShownNode] = []
    modules: Dict[str, str] = {}
    for node in gm.graph.nodes:
        if out:
            modules[out[-1].name] = out[-1].module
        if node.op == "output":
            continue
        inputs = [a.name for a in node.all_input_nodes]
        if ir.is_cast(node):
            dtype = node.args[1] if len(node.args) > 1 else None
            name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else "-"
            source = modules.get(inputs[0], "") if inputs else ""
            out.append(ShownNode(node.name, "cast", source, name, "cast",
                                 f"cast to {name} for the ops that need it", True, inputs))
            continue
        p = plan.nodes.get(node.name) or ir.precision(node)
        if p is None and node.op == "get_attr":
            value = fetch_attr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                out.append(ShownNode(node.name, "get_attr", str(node.target).rpartition(".")[0],
                                     dtype_name(value.dtype), Rule.AUTOCAST,
                                     "FP32 master weight or buffer", False, inputs))
                continue
        if p is None:
            out.append(ShownNode(node.name, node.op, "", "-", "-", "no floating output",
                                 False, inputs))
            continue
        out.append(ShownNode(node.name, p.op, p.module, dtype_name(p.dtype), p.rule, p.reason,
                             False, inputs))
    return out


def _layers(nodes: List[ShownNode]) -> Dict[str, int]:
    """Longest-path layers; then every node but the inputs moves down next to its users."""
    depth: Dict[str, int] = {}
    for n in nodes:
        depth[n.name] = 1 + max((depth.get(i, 0) for i in n.inputs), default=-1)
    users: Dict[str, List[str]] = defaultdict(list)
    for n in nodes:
        for i in n.inputs:
            users[i].append(n.name)
    for n in reversed(nodes):
        if n.op != "placeholder" and users[n.name]:
            depth[n.name] = min(depth[u] for u in users[n.name]) - 1
    return depth


CHAR_W = 7  # px per character of the 11 px monospace node labels (measured: 6.6)


def _svg(nodes: List[ShownNode]) -> str:
    """The drawn graph: one box per node (full name, monospace, box wide enough for the
    longest), one arrow per edge from producer to consumer."""
    depth = _layers(nodes)
    rows: Dict[int, List[ShownNode]] = defaultdict(list)
    for n in nodes:
        rows[depth[n.name]].append(n)
    w = max(150, CHAR_W * max(len(n.name) for n in nodes) + 16)
    h, gap_x, gap_y = 30, 20, 28
    pos = {}
    width = max(len(r) for r in rows.values()) * (w + gap_x) + gap_x
    for d, row in rows.items():
        offset = (width - len(row) * (w + gap_x)) / 2
        for i, n in enumerate(row):
            pos[n.name] = (offset + gap_x / 2 + i * (w + gap_x), 10 + d * (h + gap_y))
    height = (max(rows) + 1) * (h + gap_y) + 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
             f'class="graph"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" '
             f'markerWidth="8" markerHeight="8" orient="auto-start-reverse">'
             f'<path d="M 0 0 L 10 5 L 0 10 z" fill="#666"/></marker></defs>']
    for n in nodes:
        x2, y2 = pos[n.name]
        for i in n.inputs:
            if i in pos:
                x1, y1 = pos[i]
                parts.append(f'<line class="edge" data-from="{html.escape(i)}" '
                             f'data-to="{html.escape(n.name)}" x1="{x1 + w / 2:.0f}" '
                             f'y1="{y1 + h}" x2="{x2 + w / 2:.0f}" y2="{y2}" stroke="#666" '
                             f'marker-end="url(#arrow)"/>')
    for n in nodes:
        x, y = pos[n.name]
        title = html.escape(f"{n.name} ({n.op}) {n.dtype} {n.rule}: {n.reason}")
        dash = ' stroke-dasharray="4 2"' if n.cast else ""
        cast = ' data-cast="1"' if n.cast else ""
        parts.append(
            f'<g class="node" data-node="{html.escape(n.name)}" data-dtype="{n.dtype}"'
            f'{cast}><title>{title}</title>'
            f'<rect x="{x:.0f}" y="{y}" width="{w}" height="{h}" rx="5" '
            f'fill="{COLOURS.get(n.dtype, "#ccc")}" stroke="#333"{dash}/>'
            f'<text x="{x + w / 2:.0f}" y="{y + 19}" text-anchor="middle" font-size="11" '
            f'font-family="monospace">{html.escape(n.name)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _legend(nodes: List[ShownNode]) -> str:
    """One chip per dtype in the colour its nodes are drawn in (casts counted in the dtype
    they cast to, as drawn), and a dashed chip for the casts."""
    counts: Dict[str, int] = defaultdict(int)
    for n in nodes:
        counts[n.dtype] += 1
    chips = [f'<span class="chip legend" data-dtype="{html.escape(k)}" '
             f'style="background:{COLOURS.get(k, "#ccc")}">{html.escape(k)}: {v}</span>'
             for k, v in sorted(counts.items())]
    casts = sum(1 for n in nodes if n.cast)
    if casts:
        chips.append(f'<span class="chip legend cast" data-cast="1" style="border:1px dashed '
                     f'#333">cast (dashed outline, filled with its target dtype): {casts}</span>')
    return " ".join(chips)


def to_html(gm: fx.GraphModule, plan: Plan, title: str = "fxamp plan") -> str:
    """A self-contained HTML page of the graph coloured by precision."""
    nodes = shown_nodes(gm, plan)
    groups: Dict[str, List[ShownNode]] = defaultdict(list)
    for n in nodes:
        groups[n.module.split(".")[0] if n.module else "(root)"].append(n)
    legend = _legend(nodes)
    sections = []
    for group, members in groups.items():
        low = sum(1 for m in members if m.dtype in ("fp16", "bf16") and not m.cast)
        items = "".join(
            f'<li id="n-{html.escape(m.name)}" class="node" data-node="{html.escape(m.name)}" '
            f'title="{html.escape(m.rule + ": " + m.reason)}">'
            f'<span class="chip" style="background:{COLOURS.get(m.dtype, "#ccc")}">'
            f'{html.escape(m.dtype)}</span> <b>{html.escape(m.name)}</b> '
            f'<code>{html.escape(m.op)}</code> {"<i>cast</i>" if m.cast else ""}'
            f'<span class="reason">{html.escape(m.rule)}: {html.escape(m.reason)}</span></li>'
            for m in members)
        sections.append(f'<details{" open" if len(nodes) <= DRAW_LIMIT else ""}>'
                        f'<summary>{html.escape(group)} \u2014 {len(members)} nodes, '
                        f'{low} low precision</summary><ul>{items}</ul></details>')
    drawing = _svg(nodes) if len(nodes) <= DRAW_LIMIT else (
        f"<p>{len(nodes)} nodes: too many to draw; see the modules below.</p>")
    header = html.escape(json.dumps(plan.header))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
.chip {{ border-radius: 4px; padding: 0 6px; color: #000; }}
.reason {{ color: #666; margin-left: 1em; font-size: 90%; }}
li.node {{ list-style: none; margin: 2px 0; }}
summary {{ cursor: pointer; font-weight: bold; margin-top: 0.5em; }}
.scroll {{ overflow: auto; max-height: 70vh; border: 1px solid #ddd; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p data-header="{header}">{html.escape(plan.policy)} \u2014 {len(nodes)} nodes. {legend}</p>
<div class="scroll">{drawing}</div>
<h2>By module</h2>
{"".join(sections)}
</body></html>
"""


def _dot_id(name: str) -> str:
    return '"' + name.replace('"', '\\"') + '"'


def to_dot(gm: fx.GraphModule, plan: Plan) -> str:
    """Graphviz DOT of the graph, nodes filled by dtype, casts dashed."""
    lines = ["digraph fxamp {", "  node [shape=box, style=filled, fontsize=10];"]
    for n in shown_nodes(gm, plan):
        style = ', style="filled,dashed"' if n.cast else ""
        tip = f"{n.rule}: {n.reason}".replace('"', "'")
        lines.append(f'  {_dot_id(n.name)} [label="{n.name}\\n{n.dtype}", '
                     f'fillcolor="{COLOURS.get(n.dtype, "#ccc")}", tooltip="{tip}"{style}];')
        lines += [f"  {_dot_id(i)} -> {_dot_id(n.name)};" for i in n.inputs]
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(gm: fx.GraphModule, plan: Plan) -> str:
    """A Mermaid flowchart for embedding in Markdown."""
    nodes = shown_nodes(gm, plan)
    ids = {n.name: f"n{i}" for i, n in enumerate(nodes)}
    lines = ["flowchart TD"]
    for n in nodes:
        shape = f'{ids[n.name]}[/"{n.name} {n.dtype}"/]' if n.cast else \
            f'{ids[n.name]}["{n.name} {n.dtype}"]'
        lines.append(f"  {shape}:::{n.dtype.replace('-', 'none')}")
        lines += [f"  {ids[i]} --> {ids[n.name]}" for i in n.inputs if i in ids]
    for k, colour in COLOURS.items():
        lines.append(f"  classDef {k.replace('-', 'none')} fill:{colour}")
    return "\n".join(lines) + "\n"


def render(gm: fx.GraphModule, plan: Plan, fmt: str, title: Optional[str] = None) -> str:
    """The picture in format ``fmt``: html, dot or mermaid."""
    if fmt == "html":
        return to_html(gm, plan, title or "fxamp plan")
    if fmt == "dot":
        return to_dot(gm, plan)
    if fmt == "mermaid":
        return to_mermaid(gm, plan)
    raise ValueError(f"unknown format {fmt!r}; valid: html, dot, mermaid, svg")
