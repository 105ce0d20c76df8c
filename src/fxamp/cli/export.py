"""``fxamp export``: rewrite, export to ONNX, and report what a backend really runs in
which precision."""
from __future__ import annotations

import argparse
import sys

from ..errors import FxampError
from .factory import _config, load_factory


def _cmd_export(args: argparse.Namespace) -> int:
    import time

    from .. import amp_rewrite, plan_of

    def step(text: str) -> float:
        print(f"fxamp export: {text} ...", file=sys.stderr, flush=True)
        return time.perf_counter()

    start = step(f"rewriting {args.factory}")
    model, inputs = load_factory(args.factory, args.input_shape or [])
    gm = amp_rewrite(model, inputs, config=_config(args))
    try:
        from ..export import export_onnx, precision_report
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
        from ..model_explorer import write_onnx_node_data

        if not args.report:
            step(f"running the model on backend {args.backend}")
            report = precision_report(args.output, plan_of(gm), backend=args.backend,
                                      inputs=inputs)
        written = write_onnx_node_data(args.output, report, args.model_explorer)
        print(f"wrote {' and '.join(written)} (Model Explorer node data: planned and actual "
              "precision)")
    print(f"fxamp export: done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
