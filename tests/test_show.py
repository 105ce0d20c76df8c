"""Pictures of the plan: HTML (parsed and checked), DOT, Mermaid."""
from html.parser import HTMLParser

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import ir
from fxamp.demo import small_cnn
from fxamp.show import DRAW_LIMIT, render, shown_nodes


class _Collect(HTMLParser):
    """Checks tags nest properly and collects the data-node attributes."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "line", "rect"}

    def __init__(self):
        super().__init__()
        self.stack, self.nodes, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-node" in attrs:
            self.nodes.append(attrs["data-node"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-node" in attrs:
            self.nodes.append(attrs["data-node"])

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}>, open: {self.stack[-3:]}")
        else:
            self.stack.pop()


def _rewritten():
    model, inputs = small_cnn()
    gm = fxamp.amp_rewrite(model, inputs, fxamp.RewriteConfig.make(target="cuda"))
    return gm, fxamp.plan_of(gm)


def test_html_is_well_formed_and_names_every_node_with_its_reason():
    gm, plan = _rewritten()
    page = render(gm, plan, "html")
    parser = _Collect()
    parser.feed(page)
    assert parser.errors == [] and parser.stack == []
    assert set(plan.nodes) <= set(parser.nodes)
    casts = [n.name for n in gm.graph.nodes if ir.is_cast(n)]
    assert casts and set(casts) <= set(parser.nodes)
    assert "layer_norm is on autocast&#x27;s fp32 list for cuda" in page
    assert "<svg" in page  # small graph: drawn


@pytest.mark.slow
def test_large_graphs_collapse_by_module_instead_of_drawing():
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))
                             for _ in range(DRAW_LIMIT // 3 + 10)])
    gm = fxamp.amp_rewrite(blocks, (torch.randn(2, 8),))
    page = render(gm, fxamp.plan_of(gm), "html")
    assert "<svg" not in page and "too many to draw" in page
    # one closed section per top-level module, plus the root (the input)
    assert page.count("<details>") == len(blocks) + 1
    parser = _Collect()
    parser.feed(page)
    assert parser.errors == [] and set(fxamp.plan_of(gm).nodes) <= set(parser.nodes)


def test_dot_and_mermaid_name_every_node_with_its_dtype():
    gm, plan = _rewritten()
    dot = render(gm, plan, "dot")
    mermaid = render(gm, plan, "mermaid")
    for node in shown_nodes(gm, plan):
        assert f'"{node.name}" [label="{node.name}\\n{node.dtype}"' in dot
        assert f'"{node.name} {node.dtype}"' in mermaid
    assert dot.startswith("digraph") and mermaid.startswith("flowchart TD")
