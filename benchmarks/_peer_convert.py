"""Run one peer's FP16 conversion of an FP32 ONNX file; print one JSON line.

Run with the python of the environment that has the peer installed (see
``benchmarks/export_peers.py --peer-python``): ``python _peer_convert.py TOOL IN OUT``, TOOL
``modelopt`` (ModelOpt ONNX AutoCast, ``convert_to_mixed_precision``) or ``occ``
(onnxconverter-common ``convert_float_to_float16``). Both keep FP32 graph inputs and outputs
(``keep_io_types``), their defaults otherwise. The time is the conversion call alone.
"""
from __future__ import annotations

import json
import sys
import time


def main() -> None:
    tool, src, dst = sys.argv[1:4]
    out = {"tool": tool, "ok": False}
    try:
        import onnx

        if tool == "modelopt":
            import modelopt
            from modelopt.onnx.autocast import convert_to_mixed_precision

            out["version"] = modelopt.__version__
            start = time.perf_counter()
            model = convert_to_mixed_precision(onnx_path=src, low_precision_type="fp16",
                                               keep_io_types=True)
        else:
            import onnxconverter_common
            from onnxconverter_common import float16

            out["version"] = onnxconverter_common.__version__
            start = time.perf_counter()
            model = float16.convert_float_to_float16(onnx.load(src), keep_io_types=True)
        out["seconds"] = time.perf_counter() - start
        onnx.save(model, dst)
        out["ok"] = True
    except ImportError as err:
        out["missing"] = str(err).splitlines()[0]
    except Exception as err:  # noqa: BLE001 - a peer's failure is a result
        out["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
