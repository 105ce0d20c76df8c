"""The HTML picture in a real headless browser (Debian's chromium): it renders without console
errors, every node and edge is drawn, the legend matches the drawing, edges are arrows, long
names fit their boxes. The checks run in the page (real layout, real computed colours) and
write their results into the DOM, which chromium dumps; its console goes to stderr.

Fails (does not skip) when no browser is found and the environment variable CI is set:
``.ci/run`` installs chromium where it can."""
import html
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.show import render, shown_nodes

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

CHECK = r"""
<script>
(function () {
  const out = {nodes: [], edges: [], legend: [], markers: []};
  const colour = (el, prop) => getComputedStyle(el)[prop];
  for (const g of document.querySelectorAll("svg.graph g.node")) {
    const rect = g.querySelector("rect"), text = g.querySelector("text");
    const box = rect.getBBox();
    out.nodes.push({name: g.dataset.node, cast: g.dataset.cast === "1",
      fill: colour(rect, "fill"), dash: colour(rect, "strokeDasharray"),
      text: text.textContent, textWidth: text.getComputedTextLength(),
      x: box.x, y: box.y, w: box.width, h: box.height});
  }
  for (const line of document.querySelectorAll("svg.graph line.edge")) {
    const m = colour(line, "markerEnd");
    out.edges.push({from: line.dataset.from, to: line.dataset.to, marker: m,
      x1: line.x1.baseVal.value, y1: line.y1.baseVal.value,
      x2: line.x2.baseVal.value, y2: line.y2.baseVal.value});
  }
  for (const mk of document.querySelectorAll("svg.graph marker")) {
    out.markers.push({id: mk.id, paths: mk.querySelectorAll("path").length});
  }
  for (const chip of document.querySelectorAll(".chip.legend")) {
    out.legend.push({dtype: chip.dataset.dtype || null, cast: chip.dataset.cast === "1",
      background: colour(chip, "backgroundColor"), border: colour(chip, "borderTopStyle"),
      text: chip.textContent});
  }
  document.body.setAttribute("data-check", JSON.stringify(out));
})();
</script>
"""


def _browser():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("no headless browser (chromium) found and CI is set: .ci/run installs "
                    "Debian's chromium (apt-get install chromium); install it")
    pytest.skip("no chromium/chrome on PATH (apt-get install chromium); CI fails instead")


class LongNames(nn.Module):
    """Mixed precisions (fp16 linears, fp32 layer_norm and softmax), casts, a branch, and a
    module name far longer than the old 22-character label."""

    def __init__(self):
        super().__init__()
        self.encoder_input_projection_with_a_very_long_name = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.encoder_input_projection_with_a_very_long_name(x)
        h = self.norm(h) + h
        return torch.softmax(self.head(h), dim=-1)


def _rgb(hex_colour):
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def test_html_picture_in_headless_chromium(tmp_path):
    browser = _browser()
    gm = fxamp.amp_rewrite(LongNames(), (torch.randn(2, 8),))
    plan = fxamp.plan_of(gm)
    page = render(gm, plan, "html")
    path = tmp_path / "graph.html"
    path.write_text(page.replace("</body>", CHECK + "</body>"), encoding="utf-8")
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                          "--no-first-run", "--disable-dev-shm-usage",
                          f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
                          "--v=0", "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console  # no console errors (nor any other console output)
    found = re.search(r'data-check="([^"]*)"', run.stdout)
    assert found, "the check script did not run: " + run.stdout[:500]
    got = json.loads(html.unescape(found.group(1)))

    # every node and edge of the graph is drawn, once
    want = shown_nodes(gm, plan)
    assert sorted(n["name"] for n in got["nodes"]) == sorted(n.name for n in want)
    want_edges = sorted((i, n.name) for n in want for i in n.inputs)
    assert sorted((e["from"], e["to"]) for e in got["edges"]) == want_edges
    boxes = {n["name"]: n for n in got["nodes"]}
    for a in got["nodes"]:  # no two boxes overlap
        for b in got["nodes"]:
            if a is not b:
                assert (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                        or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"]), (a, b)

    # edges are arrows: a marker with a head, from the producer's bottom to the consumer's top
    assert got["markers"] and all(m["paths"] == 1 for m in got["markers"])
    ids = {m["id"] for m in got["markers"]}
    for e in got["edges"]:
        assert re.fullmatch(r'url\("?#(\w+)"?\)', e["marker"]).group(1) in ids, e
        src, dst = boxes[e["from"]], boxes[e["to"]]
        assert e["y1"] == pytest.approx(src["y"] + src["h"]) and e["y2"] == pytest.approx(dst["y"])

    # long names are shown whole and fit inside their boxes
    longest = max(got["nodes"], key=lambda n: len(n["name"]))
    assert len(longest["name"]) > 40
    for n in got["nodes"]:
        assert n["text"] == n["name"]
        assert 0 < n["textWidth"] <= n["w"] - 4, n

    # the legend matches the drawing: one chip per drawn colour, with its count; casts are
    # drawn dashed and the cast chip is dashed, not a colour no node is drawn in
    drawn = {}
    for n in got["nodes"]:
        drawn[n["fill"]] = drawn.get(n["fill"], 0) + 1
    colour_chips = [c for c in got["legend"] if not c["cast"]]
    assert {c["background"]: int(c["text"].rsplit(":", 1)[1]) for c in colour_chips} == drawn
    for c in colour_chips:
        assert c["background"] == _rgb(fxamp.show.COLOURS[c["dtype"]])
    casts = [n for n in got["nodes"] if n["cast"]]
    assert casts and all(n["dash"] not in ("none", "") for n in casts)
    assert all(n["dash"] in ("none", "") for n in got["nodes"] if not n["cast"])
    cast_chip = [c for c in got["legend"] if c["cast"]]
    assert len(cast_chip) == 1 and cast_chip[0]["border"] == "dashed"
    assert cast_chip[0]["background"] in ("rgba(0, 0, 0, 0)", "transparent")
    assert int(cast_chip[0]["text"].rsplit(":", 1)[1]) == len(casts)
