"""``fxamp show``: the graph coloured by precision (html, dot, svg, mermaid) or Model
Explorer node data."""
from __future__ import annotations

import argparse

from ..errors import FxampError
from ..fileio import atomic_write_text
from .factory import load_factory, load_rules, rewrite_from_args


def cmd_show(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    from .. import plan_of
    from ..show import render

    if args.format == "model-explorer":
        return _show_model_explorer(args)
    gm = rewrite_from_args(args)
    fmt = args.format or {"svg": "svg", "dot": "dot", "gv": "dot", "mmd": "mermaid",
                          "md": "mermaid"}.get(args.output.rpartition(".")[2], "html")
    if fmt == "svg":
        dot = shutil.which("dot")
        if dot is None:
            raise FxampError("--format svg needs the Graphviz 'dot' program (e.g. apt-get "
                             "install graphviz); or write --format html / dot / mermaid")
        svg = subprocess.run([dot, "-Tsvg"], input=render(gm, plan_of(gm), "dot"),
                             capture_output=True, text=True, check=True).stdout
        text = svg
    else:
        text = render(gm, plan_of(gm), fmt, title=f"fxamp plan of {args.factory}")
    atomic_write_text(args.output, text)
    print(f"wrote {args.output} ({fmt})")
    return 0


def _show_model_explorer(args: argparse.Namespace) -> int:
    from ..model_explorer import write_program_node_data

    model, inputs = load_factory(args.factory, args.input_shape or [])
    written = write_program_node_data(model, inputs, args.output, frontend=args.frontend,
                                      dtype=args.dtype, target=args.target, policy=args.policy,
                                      rules=load_rules(args.rule or []))
    print(f"wrote {' and '.join(written)} (Model Explorer node data): open the model with "
          "model_explorer.visualize_pytorch(name, exported_program=torch.export.export(model, "
          "inputs)) and load the node data")
    return 0
