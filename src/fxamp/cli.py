"""The ``fxamp`` command: a thin layer over the Python API.

fxamp plan MODULE:FACTORY [--dtype fp16|bf16] [--target cuda|cpu] [--policy P] [-o FILE]
           (or FILE.py:FACTORY, a path from the current directory)
fxamp diff OLD NEW [--format text|markdown]
fxamp check MODULE:FACTORY --plan FILE [--update]
fxamp show MODULE:FACTORY -o graph.html [--format html|dot|svg|mermaid]
fxamp audit MODULE:FACTORY [--dtype fp16|bf16] [--target cuda|cpu] [--policy P]
            [--frontend auto|fx|export] [--onnx FILE]
fxamp export MODULE:FACTORY -o model.onnx [--report report.md] [--backend auto]
fxamp demo
fxamp --version
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ._version import __version__
from .errors import FxampError
from .fileio import atomic_write_text
from .policy import COMPUTE_DTYPE_NAMES, dtype_name, parse_compute_dtype


def _shape(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-shape takes comma-separated ints like "
                                         f"1,3,224,224, got {text!r}") from None


def _compute_dtype(text: str) -> torch.dtype:
    """argparse type of --dtype: a low-precision compute dtype name."""
    try:
        return parse_compute_dtype(text)
    except FxampError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _is_file_spec(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name


def _import_file(path: str, added: List[str]) -> Any:
    """Import the Python file ``path``; the directory it needs on sys.path is appended to
    ``added`` after being put first on sys.path.

    A file inside a package (directories with ``__init__.py``) is imported under its dotted
    name with the package's parent on sys.path, so its relative imports work; any other
    file under its stem, with its own directory on sys.path (as ``python FILE.py`` does)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise FxampError(f"no such file {path!r} (from {os.getcwd()}); what to do: give "
                         "FILE.py:FACTORY with a path to an existing file, or MODULE:FACTORY")
    root, parts = os.path.dirname(full), [os.path.splitext(os.path.basename(full))[0]]
    while os.path.isfile(os.path.join(root, "__init__.py")):
        root, package = os.path.split(root)
        parts.insert(0, package)
    name = ".".join(parts)
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != full:
        if len(parts) > 1:
            raise FxampError(
                f"cannot import {path!r} as {name!r}: a different module of that name is "
                f"already imported ({getattr(loaded, '__file__', None)}); what to do: run "
                "fxamp from another directory or name the module as MODULE:FACTORY")
        name = f"fxamp_user_{parts[0]}"  # a top-level file whose stem is taken
    sys.path.insert(0, root)
    added.append(root)
    if name in sys.modules or len(parts) > 1:
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(module_name: str, added: List[str]) -> Any:
    """The module of a MODULE:FACTORY or FILE.py:FACTORY spec (the current directory first
    on sys.path, as ``python -m`` has it)."""
    here = os.path.abspath(".")
    sys.path.insert(0, here)
    added.append(here)
    try:
        if _is_file_spec(module_name):
            return _import_file(module_name, added)
        return importlib.import_module(module_name)
    except (ImportError, SyntaxError) as err:
        raise FxampError(f"cannot import {module_name!r}: {type(err).__name__}: {err}"
                         ) from None
    except TypeError as err:  # "the 'package' argument is required": a relative name
        raise FxampError(f"cannot import {module_name!r}: {err}; what to do: write a module "
                         "name (pkg.module:FACTORY) or a file path (dir/file.py:FACTORY)"
                         ) from None


def load_factory(spec: str, shapes: Sequence[Tuple[int, ...]]) -> Tuple[torch.nn.Module, tuple]:
    """Import MODULE:FACTORY (or FILE.py:FACTORY, a path from the current directory) and
    call the factory; it returns a model or (model, inputs)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise FxampError(f"expected MODULE:FACTORY or FILE.py:FACTORY (e.g. "
                         f"fxamp.demo:small_cnn, examples/audit_demo.py:build), got {spec!r}")
    added: List[str] = []
    try:
        module = _import(module_name, added)
        factory = getattr(module, attr, None)
        if factory is None:
            raise FxampError(f"{module_name!r} has no attribute {attr!r}")
        made: Any = factory()  # it may import lazily from its directory: still on sys.path
    finally:
        for entry in added:
            sys.path.remove(entry)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, inputs = made
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    else:
        model, inputs = made, None
    if shapes:
        inputs = tuple(torch.randn(*s) for s in shapes)
    if inputs is None:
        raise FxampError(f"{spec} returned only a model; give --input-shape (e.g. "
                         "--input-shape 1,3,224,224) or return (model, example_inputs)")
    return model, inputs


def _config(args: argparse.Namespace) -> Any:
    """The one RewriteConfig of the model arguments (--policy, --dtype, --target,
    --frontend) that every command rewriting a model uses."""
    from .config import RewriteConfig

    return RewriteConfig.make(args.policy, args.dtype, args.target, args.frontend)


def _rewrite(args: argparse.Namespace) -> Any:
    from . import amp_rewrite

    model, inputs = load_factory(args.factory, args.input_shape or [])
    config = _config(args)
    return amp_rewrite(model, inputs, config=config)


def _cmd_plan(args: argparse.Namespace) -> int:
    from . import plan_of

    gm = _rewrite(args)
    text = plan_of(gm).to_text()
    if args.output:
        atomic_write_text(args.output, text)
        print(f"wrote {args.output} ({len(plan_of(gm).nodes)} nodes)")
    else:
        sys.stdout.write(text)
    return 0


def _load_plan(command: str, path: str, hint: str = "") -> Optional[Any]:
    """Plan.load, or None after one line on stderr (unreadable, not UTF-8, truncated...)."""
    from .plan import Plan

    try:
        return Plan.load(path)
    except OSError as err:
        print(f"fxamp {command}: cannot read {path}: {err.strerror or err}{hint}",
              file=sys.stderr)
    except FxampError as err:
        print(f"fxamp {command}: {path}: {err}", file=sys.stderr)
    return None


def _cmd_diff(args: argparse.Namespace) -> int:
    from .plan import diff

    plans = []
    for path in (args.old, args.new):
        plan = _load_plan("diff", path)
        if plan is None:
            return 2
        plans.append(plan)
    text = diff(*plans, fmt=args.format)
    sys.stdout.write(text)
    return 1 if text else 0


def _cmd_check(args: argparse.Namespace) -> int:
    from . import plan_of
    from .plan import diff

    plan = plan_of(_rewrite(args))
    if args.update:
        plan.save(args.plan)
        print(f"wrote {args.plan} ({len(plan.nodes)} nodes)")
        return 0
    committed = _load_plan("check", args.plan, "; create it with --update")
    if committed is None:
        return 2
    text = diff(committed, plan, fmt=args.format)
    if text:
        sys.stdout.write(text)
        print(f"fxamp check: the plan of {args.factory} differs from {args.plan}; review the "
              "change, then run again with --update to accept it", file=sys.stderr)
        return 1
    print(f"fxamp check: {args.factory} matches {args.plan} ({len(plan.nodes)} nodes)")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    from . import plan_of
    from .show import render

    if args.format == "model-explorer":
        return _show_model_explorer(args)
    gm = _rewrite(args)
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
    from .model_explorer import write_program_node_data

    model, inputs = load_factory(args.factory, args.input_shape or [])
    written = write_program_node_data(model, inputs, args.output, frontend=args.frontend,
                                      dtype=args.dtype, target=args.target, policy=args.policy)
    print(f"wrote {' and '.join(written)} (Model Explorer node data): open the model with "
          "model_explorer.visualize_pytorch(name, exported_program=torch.export.export(model, "
          "inputs)) and load the node data")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from .passes.audit import summary
    from .rewriter.audit import audit

    model, inputs = load_factory(args.factory, args.input_shape or [])
    config = _config(args)
    findings = audit(model, inputs, config=config, onnx=args.onnx)
    order = ("error", "warning", "info")
    shown = [f for f in findings if order.index(f.severity) <= order.index(args.min_severity)]
    for finding in shown:
        print(finding)
    hidden = len(findings) - len(shown)
    print(summary(findings) + (f" ({hidden} below {args.min_severity} not shown)"
                               if hidden else ""))
    return 1 if any(f.severity == "error" for f in findings) else 0


def _cmd_export(args: argparse.Namespace) -> int:
    import time

    from . import amp_rewrite, plan_of

    def step(text: str) -> float:
        print(f"fxamp export: {text} ...", file=sys.stderr, flush=True)
        return time.perf_counter()

    start = step(f"rewriting {args.factory}")
    model, inputs = load_factory(args.factory, args.input_shape or [])
    gm = amp_rewrite(model, inputs, config=_config(args))
    try:
        from .export import export_onnx, precision_report
    except ImportError as err:
        raise FxampError(f"fxamp export needs onnx, onnxscript and onnxruntime ({err}); what "
                         "to do: pip install 'fxamp[onnx]'") from None
    t = step(f"exporting to {args.output}")
    export_onnx(gm, inputs, args.output)
    print(f"wrote {args.output} ({time.perf_counter() - t:.1f} s)")
    if args.report:
        t = step(f"running the model on backend {args.backend} and comparing with FP32 "
                 "PyTorch")
        report = precision_report(args.output, plan_of(gm), backend=args.backend,
                                  inputs=inputs, reference=model)
        step(f"writing the report {args.report}")
        report.save(args.report)
        print(f"wrote {args.report}: {report.summary()}")
    if args.model_explorer:
        from .model_explorer import write_onnx_node_data

        if not args.report:
            step(f"running the model on backend {args.backend}")
            report = precision_report(args.output, plan_of(gm), backend=args.backend,
                                      inputs=inputs)
        written = write_onnx_node_data(args.output, report, args.model_explorer)
        print(f"wrote {' and '.join(written)} (Model Explorer node data: planned and actual "
              "precision)")
    print(f"fxamp export: done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    low = args.dtype
    result = run_demo(steps=args.steps, dtype=low, target=args.target)
    plan = result["plan"]
    sys.stdout.write(plan.to_text())
    losses: List[float] = result["losses"]  # type: ignore[assignment]
    print(f"\n{plan.count(low)} nodes in {dtype_name(low)}, {plan.count(torch.float32)} in fp32")
    print(f"trained {len(losses)} steps with GradScaler on {result['device']}: "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, final scale {result['scale']:.0f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxamp", description="Explicit mixed precision "
                                     "for PyTorch models: plans, diffs, rewrites.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    parser.add_argument("--version", action="version",
                        version=f"fxamp {__version__} (torch {torch.__version__})")
    dtype_help = (f"compute dtype: fp16 or bf16 (names: {', '.join(COMPUTE_DTYPE_NAMES)}); "
                  "FP32 nodes are policy overrides such as fp32:head.*")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("factory", help="MODULE:FACTORY or FILE.py:FACTORY returning a model "
                       "or (model, inputs)")
        p.add_argument("--dtype", default=None, type=_compute_dtype,
                       help=dtype_help + " (default fp16, or the policy's compute=)")
        p.add_argument("--target", default="cuda", choices=["cuda", "cpu"],
                       help="whose autocast lists to mirror (default cuda)")
        p.add_argument("--policy", default=None, help='policy string, e.g. "fp32:head.*"')
        p.add_argument("--frontend", default="auto", choices=["auto", "fx", "export"],
                       help="torch.fx, torch.export, or auto: fx, then export, then fx "
                       "around untraceable submodules (default auto)")
        p.add_argument("--input-shape", type=_shape, action="append",
                       help="shape of a random FP32 input; repeat for several inputs")

    p = sub.add_parser("plan", help="print or write the precision plan of a model")
    model_args(p)
    p.add_argument("-o", "--output", help="write the plan to this file")
    p.set_defaults(func=_cmd_plan)

    d = sub.add_parser("diff", help="diff two plan files (exit 1 when they differ)")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("--format", default="text", choices=["text", "markdown"])
    d.set_defaults(func=_cmd_diff)

    c = sub.add_parser("check", help="fail (exit 1) when a model's plan differs from a file")
    model_args(c)
    c.add_argument("--plan", required=True, help="the committed plan file")
    c.add_argument("--update", action="store_true", help="rewrite the plan file instead")
    c.add_argument("--format", default="text", choices=["text", "markdown"])
    c.set_defaults(func=_cmd_check)

    s = sub.add_parser("show", help="draw the graph coloured by precision")
    model_args(s)
    s.add_argument("-o", "--output", required=True, help="graph.html, graph.dot, graph.svg, "
                   "graph.mmd")
    s.add_argument("--format", choices=["html", "dot", "svg", "mermaid", "model-explorer"],
                   help="default: from the file extension, else html; model-explorer: node "
                   "data JSON for Google's Model Explorer (OUTPUT and OUTPUT's .rule.json)")
    s.set_defaults(func=_cmd_show)

    a = sub.add_parser("audit", help="list what works against mixed precision in a model "
                       "(exit 1 when there is an error finding)")
    model_args(a)
    a.add_argument("--min-severity", default="info", choices=["error", "warning", "info"],
                   help="show findings of this severity and above (default: all)")
    a.add_argument("--onnx", metavar="FILE", help="also check this exported ONNX file (opset, "
                   "dynamic batch axis)")
    a.set_defaults(func=_cmd_audit)

    e = sub.add_parser("export", help="rewrite, export to ONNX and report what a backend "
                       "really runs in which precision")
    model_args(e)
    e.add_argument("-o", "--output", required=True, help="the ONNX file to write")
    e.add_argument("--report", help="write a precision report (.md, .json or .html)")
    e.add_argument("--backend", default="auto", choices=["auto", "onnxruntime", "tensorrt"],
                   help="backend the report inspects (default auto: TensorRT when it and a "
                   "GPU are there, else onnxruntime)")
    e.add_argument("--model-explorer", metavar="FILE.json",
                   help="also write Model Explorer node data for the ONNX file: planned "
                   "precision to FILE.json, actual to FILE.actual.json (rule and reason go "
                   "into the ONNX nodes' metadata)")
    e.set_defaults(func=_cmd_export)

    m = sub.add_parser("demo", help="rewrite and train the built-in small CNN")
    m.add_argument("--steps", type=int, default=30)
    m.add_argument("--dtype", default=torch.float16, type=_compute_dtype,
                   help=dtype_help + " (default fp16)")
    m.add_argument("--target", default="cuda", choices=["cuda", "cpu"])
    m.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``fxamp`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except FxampError as err:
        print(f"fxamp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
