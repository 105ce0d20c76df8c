"""The ``fxamp`` command: a thin layer over the Python API.

fxamp plan MODULE:FACTORY [--dtype fp16|bf16] [--target cuda|cpu|tensorrt] [--policy P] [-o FILE]
           [--partition auto|blocks|flat]
           (or FILE.py:FACTORY, a path from the current directory)
fxamp diff OLD NEW [--format text|markdown]
fxamp check MODULE:FACTORY --plan FILE [--update] [--partition auto|blocks|flat]
fxamp show MODULE:FACTORY -o graph.html [--format html|dot|svg|mermaid]
fxamp audit MODULE:FACTORY [--dtype fp16|bf16] [--target cuda|cpu|tensorrt] [--policy P]
            [--frontend auto|fx|export] [--onnx FILE]
fxamp export MODULE:FACTORY -o model.onnx [--report report.md] [--backend auto] [--dynamic]
fxamp demo
fxamp --version

The command is a package, one module per command group: ``factory`` (loading
MODULE:FACTORY, the RewriteConfig of the model arguments), ``plans`` (plan, diff, check),
``show``, ``audit``, ``export``, ``demo``; ``terminal`` (any stream encoding, a closed
standard output, termination signals, the per-file size limit); ``refusals`` (the flags
refused rather than ignored: given twice, contradicting the policy, unused, more
``--input-shape`` than inputs); this module holds the argument parser and :func:`main`.
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Any, Optional, Sequence, Tuple

import torch

from .._version import __version__
from ..config import FRONTENDS, PARTITIONS
from ..errors import FxampError, excerpt, short_path, shorten
from ..export.backends import CHOICES as BACKEND_CHOICES
from ..policy import COMPUTE_DTYPE_NAMES, TARGETS, TRAINING_TARGETS, parse_compute_dtype
from .audit import cmd_audit
from .demo import cmd_demo
from .export import cmd_export
from .factory import load_factory
from .plans import cmd_check, cmd_diff, cmd_plan
from .refusals import Once, refuse_ignored_flags
from .show import cmd_show
from .terminal import (Terminated, file_size_errors, result_stream, streams_for_any_encoding,
                       terminating_raises)

__all__ = ["main", "build_parser", "load_factory"]


def _shape(text: str) -> Tuple[int, ...]:
    """argparse type of --input-shape: comma-separated sizes, each 0 <= n < 2**63."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-shape takes comma-separated ints like "
                                         f"1,3,224,224, got {excerpt(text)}") from None
    bad = [n for n in shape if not 0 <= n < 2 ** 63]
    if bad:
        raise argparse.ArgumentTypeError(f"--input-shape sizes are integers from 0 to 2**63-1, "
                                         f"got {bad[0]} in {excerpt(text)}")
    return shape


def _positive(text: str) -> int:
    """argparse type of a count that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {excerpt(text)}"
                                         ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _compute_dtype(text: str) -> torch.dtype:
    """argparse type of --dtype: a low-precision compute dtype name."""
    try:
        return parse_compute_dtype(text)
    except FxampError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxamp", description="Explicit mixed precision "
                                     "for PyTorch models: plans, diffs, rewrites. Exit "
                                     "status: 0 success, 1 a plan differs (diff, check) or an "
                                     "error finding (audit), 2 any failure.")
    _global_flags(parser, False)
    parser.add_argument("--version", action="version",
                        version=f"fxamp {__version__} (torch {torch.__version__})")
    dtype_help = (f"compute dtype: fp16 or bf16 (names: {', '.join(COMPUTE_DTYPE_NAMES)}); "
                  "FP32 nodes are policy overrides such as fp32:head.*")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser = sub.add_parser

    def with_flags(*a: Any, **k: Any) -> argparse.ArgumentParser:
        p = add_parser(*a, **k)
        _global_flags(p, argparse.SUPPRESS)  # after the command too, not overriding
        return p

    sub.add_parser = with_flags  # type: ignore[method-assign]

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("factory", help="MODULE:FACTORY or FILE.py:FACTORY returning a model "
                       "or (model, inputs)")
        p.add_argument("--dtype", default=None, type=_compute_dtype, action=Once,
                       help=dtype_help + " (default fp16, or the policy's compute=; one "
                       "that contradicts the policy's is refused)")
        p.add_argument("--target", default="cuda", choices=list(TARGETS), action=Once,
                       help="cuda or cpu: whose autocast lists to mirror (training; default "
                       "cuda, or the policy's target=: a plan file is the same on every "
                       "machine, whatever device the factory's model is on); tensorrt: a "
                       "deployment plan, all FP16 except where numbers or the engine need "
                       "FP32 (one that contradicts the policy's is refused)")
        p.add_argument("--policy", default=None, action=Once,
                       help='policy string, e.g. "fp32:head.*" (items comma-separated)')
        p.add_argument("--frontend", default="auto", choices=list(FRONTENDS), action=Once,
                       help="torch.fx, torch.export, or auto: fx, then export, then fx "
                       "around untraceable submodules (default auto)")
        p.add_argument("--input-shape", type=_shape, action="append",
                       help="shape of an FP32 input (random for export; on device meta, without "
                       "data, for the commands that only plan); repeat for several inputs, "
                       "one per input of the forward, in order")
        p.add_argument("--rule", action="append", metavar="MODULE:RULE",
                       help="a user decision rule (MODULE:NAME or FILE.py:NAME naming a "
                       "fxamp.DecisionRule object or subclass, or a list of them); repeat "
                       "for several")

    def partition_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--partition", default="auto", choices=list(PARTITIONS), action=Once,
                       help="auto: one graph of the whole model, as amp_rewrite(model, "
                       "example) returns it (default); blocks: the "
                       "plan of the model in block mode, its blocks and the glue's modules "
                       "regions of their own, planned on the example as its first call "
                       "(what amp_rewrite(model, example, RewriteConfig.make(..., "
                       "partition='blocks'), inplace=True) trains with, and the in-place "
                       "default for a model whose glue fx does not trace, a Hugging Face "
                       "model); flat: as auto")

    p = sub.add_parser("plan", help="print or write the precision plan of a model")
    model_args(p)
    partition_arg(p)
    p.add_argument("-o", "--output", action=Once, help="write the plan to this file")
    p.set_defaults(func=cmd_plan, result_on_stdout=True)

    d = sub.add_parser("diff", help="diff two plan files (exit 1 when they differ)")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("--format", default="text", choices=["text", "markdown"], action=Once)
    d.set_defaults(func=cmd_diff, result_on_stdout=True)

    c = sub.add_parser("check", help="fail (exit 1) when a model's plan differs from a file")
    model_args(c)
    partition_arg(c)
    c.add_argument("--plan", required=True, action=Once, help="the committed plan file")
    c.add_argument("--update", action="store_true", help="rewrite the plan file instead")
    c.add_argument("--format", default="text", choices=["text", "markdown"], action=Once,
                   help="of the differences (not with --update)")
    c.set_defaults(func=cmd_check, result_on_stdout=True)

    s = sub.add_parser("show", help="draw the graph coloured by precision")
    model_args(s)
    s.add_argument("-o", "--output", required=True, action=Once, help="graph.html, "
                   "graph.dot, graph.svg, graph.mmd")
    s.add_argument("--format", action=Once,
                   choices=["html", "dot", "svg", "mermaid", "model-explorer"],
                   help="default: from the file extension, else html; model-explorer: node "
                   "data JSON for Google's Model Explorer (OUTPUT and OUTPUT's .rule.json)")
    s.set_defaults(func=cmd_show)

    a = sub.add_parser("audit", help="list what works against mixed precision in a model "
                       "(exit 1 when there is an error finding)")
    model_args(a)
    a.add_argument("--min-severity", default="info", choices=["error", "warning", "info"],
                   action=Once,
                   help="show findings of this severity and above (default: all)")
    a.add_argument("--onnx", metavar="FILE", action=Once, help="also check this exported "
                   "ONNX file (opset, dynamic batch axis)")
    a.set_defaults(func=cmd_audit, result_on_stdout=True)

    e = sub.add_parser("export", help="rewrite, export to ONNX and report what a backend "
                       "really runs in which precision")
    model_args(e)
    e.add_argument("-o", "--output", required=True, action=Once,
                   help="the ONNX file to write")
    e.add_argument("--report", action=Once,
                   help="write a precision report (.md, .json or .html)")
    e.add_argument("--backend", default="auto", choices=list(BACKEND_CHOICES), action=Once,
                   help="backend the report inspects (default auto: TensorRT when it and a "
                   "GPU are there, else onnxruntime; only with --report or --model-explorer)")
    e.add_argument("--model-explorer", metavar="FILE.json", action=Once,
                   help="also write Model Explorer node data for the ONNX file: planned "
                   "precision to FILE.json, actual to FILE.actual.json (rule and reason go "
                   "into the ONNX nodes' metadata)")
    e.add_argument("--dynamic", action="store_true",
                   help="write a file whose batch axis (dim 0 of every tensor input) and "
                   "sequence axis (dim 1 of integer inputs of 2+ dimensions: token ids, "
                   "masks) take any size; the checks run at the example's sizes and at "
                   "others (default: every axis fixed at the example's size)")
    e.set_defaults(func=cmd_export)

    m = sub.add_parser("demo", help="rewrite and train the built-in small CNN")
    m.add_argument("--steps", type=_positive, default=30, action=Once,
                   help="training steps (default 30)")
    m.add_argument("--dtype", default=torch.float16, type=_compute_dtype, action=Once,
                   help=dtype_help + " (default fp16)")
    m.add_argument("--target", default=None, choices=list(TRAINING_TARGETS), action=Once,
                   help="whose autocast lists to mirror (default: the device the demo "
                   "trains on: cuda when there is a GPU, else cpu)")
    m.set_defaults(func=cmd_demo, result_on_stdout=True)
    return parser


def _global_flags(parser: argparse.ArgumentParser, default: Any) -> None:
    """-v and --debug, on the main parser and (with ``SUPPRESS``) on every command."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log progress")
    parser.add_argument("--debug", action="store_true", default=default,
                        help="print the traceback of a failure (and log at debug level)")


def _unexpected(err: BaseException) -> str:
    """One line for a failure that is not an FxampError: its type, message and place."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    where = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
    place = (f" (at {short_path(where[0].filename)}, line {where[0].lineno}, in "
             f"{where[0].name})" if where else "")
    return (f"unexpected {type(err).__name__}: {shorten(text) if text else '-'}{place}; "
            "what to do: run again with --debug for the traceback; if the cause is not in "
            "your model or arguments, report it to fxamp with that traceback")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``fxamp`` console script. Exit status: 0 success, 1 a plan
    differs (``diff``, ``check``) or an error finding (``audit``), 2 every failure, with
    one line on stderr (``--debug`` adds the traceback); 130 after Ctrl-C, 128 + N after
    a termination signal N (SIGTERM: 143), each once its temporary files are removed."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else
                        logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        with terminating_raises(), streams_for_any_encoding(), file_size_errors():
            refuse_ignored_flags(args)  # before any work
            if getattr(args, "result_on_stdout", False) and not getattr(args, "output", None):
                result_stream(args.command, " or give -o FILE" if args.command == "plan"
                              else "")  # (refused before the work when it is closed)
            return args.func(args)
    except Terminated as stop:
        print(f"fxamp {args.command}: terminated by {stop.name}", file=sys.stderr)
        return 128 + stop.signum
    except FxampError as err:
        if args.debug:
            traceback.print_exc()
        print(f"fxamp {args.command}: error: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"fxamp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - every failure is exit 2 and one line
        if args.debug:
            traceback.print_exc()
        print(f"fxamp {args.command}: error: {_unexpected(err)}", file=sys.stderr)
    return 2
