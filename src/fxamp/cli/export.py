"""``fxamp export``: rewrite, export to ONNX, and report what a backend really runs in
which precision."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, Tuple

from ..errors import FxampError
from ..result import plan_of
from .factory import config_from_args, load_factory
from .quiet import quiet


def _same_outputs(args: argparse.Namespace) -> None:
    """FxampError when two outputs (-o, --report, --model-explorer and its companion) name
    one file, however spelled (relative, through a symlink): one would overwrite the other."""
    named = [("-o", args.output), ("--report", args.report)]
    if args.model_explorer:
        from ..model_explorer import companion_path

        named += [("--model-explorer", args.model_explorer),
                  ("--model-explorer's companion", companion_path(args.model_explorer,
                                                                 "actual"))]
    seen: Dict[str, Tuple[str, str]] = {}
    for option, path in named:
        if not path:
            continue
        real = os.path.realpath(path)
        if real == os.path.realpath(os.devnull):
            continue
        if real in seen:
            first, spelled = seen[real]
            raise FxampError(f"{first} {spelled} and {option} {path} are the same file; one "
                             "would overwrite the other; nothing was written. what to do: "
                             f"give {option} another path")
        seen[real] = (option, path)


def _config(args: argparse.Namespace, model: Any, inputs: tuple, dynamic: bool) -> Any:
    """The command's RewriteConfig; with ``--dynamic`` the ``torch.export`` front end's graph
    is traced with the batch and sequence axes dynamic (``export_onnx``'s ``"auto"`` axes,
    keyed by the forward's names), so the export need not trace the model again."""
    config = config_from_args(args)
    if not dynamic or args.frontend == "fx":
        return config
    from ..frontends.aten import default_dynamic_shapes

    try:
        shapes = default_dynamic_shapes(model, tuple(inputs), {})
    except FxampError:  # (inputs that do not bind to the forward: the rewrite says so)
        return config
    return config.replace(dynamic_shapes=shapes)


def cmd_export(args: argparse.Namespace) -> int:
    """Rewrite, export, report: every output is written only once all of it succeeded."""
    import time

    _same_outputs(args)

    from .. import amp_rewrite
    from ..fileio import Staging

    def step(text: str) -> float:
        print(f"fxamp export: {text} ...", file=sys.stderr, flush=True)
        return time.perf_counter()

    start = step(f"rewriting {args.factory}")
    with Staging() as staging:
        onnx_path = staging.path(args.output)
        report_path = staging.path(args.report) if args.report else None
        explorer_path = staging.path(args.model_explorer) if args.model_explorer else None
        model, inputs = load_factory(args.factory, args.input_shape or [])
        dynamic = getattr(args, "dynamic", False)
        gm = amp_rewrite(model, inputs, config=_config(args, model, inputs, dynamic))
        try:
            from ..export import export_onnx, precision_report
        except ImportError as err:
            raise FxampError(f"fxamp export needs onnx, onnxscript and onnxruntime ({err}); "
                             "what to do: pip install 'fxamp[onnx]'") from None
        t = step(f"exporting to {args.output}")
        quiet(export_onnx)(gm, inputs, onnx_path, dynamic_shapes="auto" if dynamic else None)
        plan = None if dynamic else plan_of(gm)  # (dynamic: the file's, which it follows)
        done = [f"wrote {args.output} ({time.perf_counter() - t:.1f} s)"]
        report = None
        if args.report:
            step(f"running the model on backend {args.backend} and comparing with FP32 "
                 "PyTorch")
            report = precision_report(onnx_path, plan, backend=args.backend,
                                      inputs=inputs, reference=model)
            step(f"writing the report {args.report}")
            report.save(report_path)  # type: ignore[arg-type]
            done.append(f"wrote {args.report}: {report.summary()}")
        if args.model_explorer:
            from ..model_explorer import companion_path, write_onnx_node_data

            if report is None:
                step(f"running the model on backend {args.backend}")
                report = precision_report(onnx_path, plan, backend=args.backend,
                                          inputs=inputs)
            write_onnx_node_data(onnx_path, report, explorer_path)  # type: ignore[arg-type]
            written = [args.model_explorer, companion_path(args.model_explorer, "actual")]
            done.append(f"wrote {' and '.join(written)} (Model Explorer node data: planned "
                        "and actual precision)")
        staging.commit()
    for line in done:
        print(line)
    print(f"fxamp export: done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
