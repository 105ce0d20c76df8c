"""The precision report: per ONNX node, what the plan asked for and what really runs.

JSON schema ``fxamp.precision_report/1`` (``PrecisionReport.to_json``)::

    {"schema": "fxamp.precision_report/1",
     "model": "model.onnx", "backend": "onnxruntime", "device": "CPUExecutionProvider",
     "exporter": "dynamo",
     "summary": {"layers": 12, "mapped": 11, "fallbacks": 3},
     "numerics": [{"output": "fc_fp32", "max_abs": 0.0012, "max_rel": 0.0004,
                   "ref_max": 3.1, "ok": true}],
     "layers": [{"onnx_node": "node_conv2d", "op_type": "Conv", "fx_node": "conv1",
                 "module": "conv1", "planned": "fp16", "exported": "fp16", "actual": "fp32",
                 "fallback": true, "note": "...",
                 "predictions": {"onnxruntime-cuda": "prediction (...): ..."}}]}

dtypes are short names ("fp16", "bf16", "fp32", ...) or null where a node has no floating
computation (shape arithmetic) or the value is unknown. Keys are stable; new keys may be added
within schema version 1, none removed or renamed.

``predictions`` (added within version 1; absent in older documents, read as ``{}``): for a
layer planned fp16/bf16, backend ("tensorrt", "onnxruntime-cuda") -> a note, for each backend
whose PUBLISHED operator table says it cannot run the op in that dtype (see
``fxamp.export.predict``). These are predictions from documentation, not measurements:
they do not set ``fallback`` and do not count in ``summary``. Each note starts with
"prediction (<source>)".
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List

from ..errors import FxampError
from ..fileio import atomic_write_text
from .errors import (BackendUnavailableError, ExportError, NumericsError,  # noqa: F401
                     UnknownBackendError)
from .layers import LayerPrecision
from .predict import predicted_fallbacks

SCHEMA = "fxamp.precision_report/1"


@dataclass
class PrecisionReport:
    """What the backend really runs, per layer, against the fxamp plan;
    ``fxamp.export.precision_report`` makes one.

    Attributes:
        layers: one ``LayerPrecision`` per ONNX node: planned, exported and actual
            precision, the fx node and module it came from.
        backend: the backend that ran the model (``"onnxruntime"``, ``"tensorrt"``).
        device: what it ran on (an onnxruntime provider, or ``"inspector JSON"``).
        model: the ONNX file's name.
        exporter: the exporter that wrote the file (``"dynamo"``, ``"torchscript"``).
        numerics: per-output errors against the FP32 model, when it was given.
    """

    layers: List[LayerPrecision] = field(default_factory=list)
    backend: str = ""
    device: str = ""
    model: str = ""
    exporter: str = ""
    numerics: List[Dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.add_predictions()

    def add_predictions(self) -> "PrecisionReport":
        """Fill each layer's ``predictions`` (where empty) from the static operator tables of
        ``fxamp.export.predict``: which backends are documented not to run the op in its
        planned fp16/bf16. Runs on construction; call again after changing layers."""
        for layer in self.layers:
            if not layer.predictions:
                layer.predictions = predicted_fallbacks(layer.op_type, layer.planned)
        return self

    @property
    def predicted(self) -> List[LayerPrecision]:
        """Layers some backend's published operator table says will not run in the planned
        dtype (predictions, not measurements)."""
        return [layer for layer in self.layers if layer.predictions]

    @property
    def fallbacks(self) -> List[LayerPrecision]:
        """Layers whose precision (exported or actual) differs from the plan."""
        return [layer for layer in self.layers if layer.fallback]

    @property
    def mapped(self) -> List[LayerPrecision]:
        """Layers traced back to an fx node of the rewritten graph."""
        return [layer for layer in self.layers if layer.fx_node]

    def summary(self) -> str:
        """One line: layers, mapped layers, fallbacks and the numerics' worst error."""
        n = len(self.layers)
        line = (f"{self.backend} ({self.device}): {n} layers, {len(self.mapped)} mapped to fx "
                f"nodes, {len(self.fallbacks)} fallbacks (precision differs from the plan)")
        bad = [r for r in self.numerics if not r.get("ok", True)]
        if self.numerics:
            worst = max(r["max_abs"] for r in self.numerics)
            line += (f"; numerics vs FP32 PyTorch: max abs error {worst:.3g}"
                     + (f", {len(bad)} output(s) over tolerance" if bad else ", within tolerance"))
        true16 = [r for r in self.numerics if "true_fp16_max_abs" in r]
        skipped = next((r["true_fp16_skipped"] for r in self.numerics
                        if "true_fp16_skipped" in r), None)
        if skipped:
            line += f"; true FP16 not checked: {skipped}"
        if true16:
            worst16 = max(r["true_fp16_max_abs"] for r in true16)
            wrong = [r for r in true16 if not r.get("true_fp16_ok", True)]
            line += (f"; true FP16 (onnx.reference): max abs error {worst16:.3g}"
                     + (f", {len(wrong)} output(s) over tolerance" if wrong
                        else ", within tolerance"))
        return line

    # -- JSON ------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The report as the dict ``to_json`` writes."""
        return {"schema": SCHEMA, "model": self.model, "backend": self.backend,
                "device": self.device, "exporter": self.exporter,
                "summary": {"layers": len(self.layers), "mapped": len(self.mapped),
                            "fallbacks": len(self.fallbacks)},
                "numerics": [dict(r) for r in self.numerics],
                "layers": [asdict(layer) for layer in self.layers]}

    def to_json(self, indent: int = 2) -> str:
        """The report as JSON (schema ``fxamp.precision_report/1``, see the module doc).

        Args:
            indent: the JSON indentation.

        Returns:
            The JSON text, ending with a newline.
        """
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "PrecisionReport":
        """Read a report ``to_json`` wrote.

        Args:
            text: the JSON text.

        Returns:
            The report.

        Raises:
            FxampError: the text is not a ``fxamp.precision_report/1`` document.
        """
        data = json.loads(text)
        if data.get("schema") != SCHEMA:
            raise FxampError(f"not a {SCHEMA} document (schema={data.get('schema')!r})")
        known = set(LayerPrecision.__dataclass_fields__)
        return cls(layers=[LayerPrecision(**{k: v for k, v in layer.items() if k in known})
                           for layer in data["layers"]],
                   backend=data.get("backend", ""), device=data.get("device", ""),
                   model=data.get("model", ""), exporter=data.get("exporter", ""),
                   numerics=list(data.get("numerics", [])))

    def _ordered(self) -> List[LayerPrecision]:
        return self.fallbacks + [layer for layer in self.layers if not layer.fallback]

    # -- Markdown --------------------------------------------------------------------
    def to_markdown(self) -> str:
        """A summary line and a table, fallbacks first."""
        def cell(value: Any) -> str:
            text = "-" if value in (None, "") else str(value)
            return text.replace("|", "\\|").replace("\n", " ")

        out = [f"**fxamp precision report** for `{self.model}`: {self.summary()}", ""]
        if self.numerics:
            out += ["| output | max abs error | max rel error | ok | true FP16 max abs error "
                    "| true FP16 ok |", "|---|---|---|---|---|---|"]
            out += [f"| {cell(r['output'])} | {r['max_abs']:.3g} | {r['max_rel']:.3g} | "
                    f"{'yes' if r['ok'] else '**NO**'} | "
                    + (f"{r['true_fp16_max_abs']:.3g} | "
                       f"{'yes' if r['true_fp16_ok'] else '**NO**'} |"
                       if "true_fp16_max_abs" in r else "- | - |") for r in self.numerics]
            out.append("")
        out += ["| | onnx node | op | fx node | module | planned | exported | actual | note |",
                "|---|---|---|---|---|---|---|---|---|"]
        for layer in self._ordered():
            mark = "**fallback**" if layer.fallback else ""
            out.append("| " + " | ".join([mark, cell(layer.onnx_node), cell(layer.op_type),
                                           cell(layer.fx_node), cell(layer.module),
                                           cell(layer.planned), cell(layer.exported),
                                           cell(layer.actual), cell(layer.note)]) + " |")
        if self.predicted:
            out += ["", ("**Predicted fallbacks (not measured)**: from published operator "
                         "tables (fxamp.export.predict), for layers planned in FP16/BF16"), "",
                    "| onnx node | op | planned | backend | prediction |", "|---|---|---|---|---|"]
            for layer in self.predicted:
                for backend, note in layer.predictions.items():
                    out.append("| " + " | ".join([cell(layer.onnx_node), cell(layer.op_type),
                                                   cell(layer.planned), cell(backend),
                                                   cell(note)]) + " |")
        return "\n".join(out) + "\n"

    # -- HTML ------------------------------------------------------------------------
    def to_html(self) -> str:
        """A self-contained page: layers coloured by actual precision, fallbacks first and
        highlighted."""
        esc = html.escape
        rows = []
        for layer in self._ordered():
            dtype = layer.actual or layer.exported or "none"
            cls = ("fallback " if layer.fallback else "") + f"dt-{esc(dtype)}"
            cells = [layer.onnx_node, layer.op_type, layer.fx_node, layer.module, layer.planned,
                     layer.exported, layer.actual, layer.note]
            rows.append(f'<tr class="{cls}">' + "".join(
                f"<td>{esc('-' if c in (None, '') else str(c))}</td>" for c in cells) + "</tr>")
        numerics = ""
        if self.numerics:
            numerics = ("<h2>Numerics against the FP32 PyTorch model</h2><table><tr><th>output"
                        "</th><th>max abs error</th><th>max rel error</th><th>ok</th>"
                        "<th>true FP16 max abs error</th><th>true FP16 ok</th></tr>"
                        + "".join(f"<tr><td>{esc(str(r['output']))}</td><td>{r['max_abs']:.3g}"
                                  f"</td><td>{r['max_rel']:.3g}</td><td>"
                                  f"{'yes' if r['ok'] else 'NO'}</td><td>"
                                  + (f"{r['true_fp16_max_abs']:.3g}</td><td>"
                                     f"{'yes' if r['true_fp16_ok'] else 'NO'}"
                                     if "true_fp16_max_abs" in r else "-</td><td>-")
                                  + "</td></tr>" for r in self.numerics) + "</table>")
        predicted = ""
        if self.predicted:
            predicted = ("<h2>Predicted fallbacks (not measured)</h2><table><tr><th>onnx node"
                         "</th><th>op</th><th>planned</th><th>backend</th><th>prediction</th>"
                         "</tr>" + "".join(
                             f"<tr><td>{esc(layer.onnx_node)}</td><td>{esc(layer.op_type)}</td>"
                             f"<td>{esc(str(layer.planned))}</td><td>{esc(backend)}</td>"
                             f"<td>{esc(note)}</td></tr>"
                             for layer in self.predicted
                             for backend, note in layer.predictions.items()) + "</table>")
        style = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
                 "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}"
                 "tr.dt-fp16{background:#d8ecff}tr.dt-bf16{background:#e4dcff}"
                 "tr.dt-fp32{background:#fff3d6}tr.dt-none{background:#f4f4f4}"
                 "tr.fallback{outline:2px solid #d00;font-weight:bold}"
                 "tr.fallback td:first-child::before{content:'\\26a0  '}")
        head = ("<tr><th>onnx node</th><th>op</th><th>fx node</th><th>module</th><th>planned"
                "</th><th>exported</th><th>actual</th><th>note</th></tr>")
        return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>fxamp precision "
                f"report</title><style>{style}</style></head><body>"
                f"<h1>fxamp precision report: {esc(self.model)}</h1>"
                f"<p>{esc(self.summary())}</p>{numerics}"
                f"<h2>Layers (fallbacks first)</h2><table>{head}{''.join(rows)}</table>"
                f"{predicted}</body></html>\n")

    def save(self, path: str) -> str:
        """Write the report atomically.

        Args:
            path: the file; the format follows its extension (``.json``, ``.html`` /
                ``.htm``, else markdown).

        Returns:
            ``path``.

        Raises:
            OutputFileError: the file cannot be written.
        """
        ext = path.rpartition(".")[2].lower()
        text = (self.to_json() if ext == "json" else self.to_html() if ext in ("html", "htm")
                else self.to_markdown())
        atomic_write_text(path, text)
        return path
