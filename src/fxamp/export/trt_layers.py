"""Read TensorRT engine-inspector JSON: per-layer precision, fused ONNX nodes, reformats.

The input is what ``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)``
returns (also written by ``trtexec --exportLayerInfo=FILE --profilingVerbosity=detailed``):
``{"Layers": [...], "Bindings": [...]}``. Tested on engine files NVIDIA publishes in the
TensorRT OSS repository (``tests/data/trt/``), not on a locally built engine.

What real files look like (and what this module handles):

* a layer's tensors carry a ``"Format/Datatype"`` string such as ``"Row major linear FP32"``,
  ``"Channel major FP16 format where channel % 8 == 0"`` or ``"Thirty-two wide channel
  vectorized row major Int8 format"``;
* fused layers are named after their ONNX nodes joined by ``" + "``
  (``"Conv_5 + Add_6 + Relu_7"``), pointwise fusions are wrapped (``"PWN(Clip_16)"``), and the
  name may also hold initializer names (``"features.0.0.weight"``) and TensorRT's own layers
  (``"(Unnamed Layer* 849) [Shuffle]"``);
* layers TensorRT inserts to change a tensor's layout or type are named ``"Reformatting
  CopyNode for Input Tensor 0 to <layer>"`` (LayerType ``Reformat`` or ``NoOp``); Q/DQ
  reformats keep the ONNX ``QuantizeLinear_*`` name with ``"Origin": "QDQ"``. Those that
  change the data type are the engine's precision boundaries.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from ..errors import FxampError

_TOKENS = {"fp32": "fp32", "float": "fp32", "float32": "fp32", "fp16": "fp16", "half": "fp16",
           "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16", "int8": "int8",
           "fp8": "fp8", "int32": "int32", "int64": "int64", "bool": "bool", "uint8": "uint8",
           "int4": "int4", "fp4": "fp4", "double": "fp64"}
_REFORMAT_PREFIX = "Reformatting CopyNode for "
_REFORMAT_TARGET = re.compile(r"^Reformatting CopyNode for (Input|Output) Tensor \d+ to (.*)$")
_INTERNAL = re.compile(r"\(Unnamed Layer\* \d+\)|^(copied_)?\w+_after_|_output$")


class EngineInfoError(FxampError):
    """The TensorRT inspector JSON cannot be read."""


def trt_dtype(text: str) -> Optional[str]:
    """The data type named in a TensorRT ``Format/Datatype`` or weights ``Type`` string:
    ``"Row major linear FP32"`` -> ``"fp32"``, ``"Half"`` -> ``"fp16"``, ``"DataType.HALF"``
    -> ``"fp16"``, ``"... Int8 format"`` -> ``"int8"``; None when no type is named."""
    for word in re.split(r"[^a-z0-9]+", text.lower()):
        if word in _TOKENS:
            return _TOKENS[word]
    return None


def _split_top(text: str, seps: Tuple[str, ...]) -> List[str]:
    """Split on any separator in ``seps`` outside parentheses and brackets."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0:
            sep = next((s for s in seps if text.startswith(s, i)), None)
            if sep:
                parts.append(text[start:i])
                i += len(sep)
                start = i
                continue
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def fused_names(name: str) -> List[str]:
    """The names a (fused) TensorRT layer name is made of, in order: ``"Conv_12 +
    PWN(Clip_16)"`` -> ``["Conv_12", "Clip_16"]``; ``PWN(a, b)`` unwraps to both, ``||``
    (horizontal fusion) splits too. Reformat layers name no nodes of their own: []."""
    if name.startswith(_REFORMAT_PREFIX):
        return []
    out: List[str] = []
    for part in _split_top(name, (" + ", "||")):
        m = re.fullmatch(r"PWN\((.*)\)", part)
        if m:
            out += [n for p in _split_top(m.group(1), (",", " + ")) for n in fused_names(p)]
        else:
            out.append(part)
    return out


@dataclass
class TrtLayer:
    """One engine layer as the inspector reports it."""

    name: str
    layer_type: str
    inputs: List[Tuple[str, Optional[str]]]   # (tensor name, dtype)
    outputs: List[Tuple[str, Optional[str]]]
    parts: List[str]                          # names it was fused from (see fused_names)
    origin: str = ""
    weights: Optional[str] = None             # dtype of its weights, when it has any
    onnx_nodes: List[str] = field(default_factory=list)

    @property
    def precision(self) -> Optional[str]:
        """The type it computes in: that of its first typed input (its output's if none)."""
        return next((d for _, d in self.inputs + self.outputs if d), None)

    @property
    def output_precision(self) -> Optional[str]:
        return next((d for _, d in self.outputs if d), None)

    @property
    def is_reformat(self) -> bool:
        """Inserted by TensorRT (or from a Q/DQ pair) to change layout or type."""
        return (self.layer_type == "Reformat" or self.name.startswith(_REFORMAT_PREFIX)
                or self.origin in ("REFORMAT", "QDQ"))

    @property
    def boundary(self) -> Optional[Tuple[str, str]]:
        """(from, to) data types when this is a reformat that changes the type."""
        src, dst = self.precision, self.output_precision
        if self.is_reformat and src and dst and src != dst:
            return (src, dst)
        return None

    @property
    def for_layer(self) -> Optional[str]:
        """For a "Reformatting CopyNode ... to X" layer: X, the layer it feeds or drains."""
        m = _REFORMAT_TARGET.match(self.name)
        return m.group(2) if m else None


def load_engine_info(source: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """The inspector JSON from a path, a JSON string or an already parsed dict."""
    if isinstance(source, dict):
        info = source
    else:
        text = str(source)
        try:
            if not text.lstrip().startswith("{"):
                with open(text, encoding="utf-8") as fh:
                    text = fh.read()
            info = json.loads(text)
        except (OSError, ValueError) as err:
            raise EngineInfoError(f"cannot read TensorRT inspector JSON {str(source)[:80]!r}: "
                                  f"{err}; what to do: pass the file written by trtexec "
                                  "--exportLayerInfo (with --profilingVerbosity=detailed) or "
                                  "IEngineInspector.get_engine_information(JSON)") from None
    if not isinstance(info.get("Layers"), list):
        raise EngineInfoError("TensorRT inspector JSON has no 'Layers' list; what to do: build "
                              "the engine with profiling verbosity DETAILED (trtexec "
                              "--profilingVerbosity=detailed), else layers are only names")
    return info


def _tensors(entry: Dict[str, Any], key: str) -> List[Tuple[str, Optional[str]]]:
    out = []
    for t in entry.get(key, []) or []:
        if isinstance(t, dict):
            fmt = t.get("Format/Datatype", t.get("DataType", t.get("Datatype", "")))
            out.append((str(t.get("Name", "")), trt_dtype(str(fmt))))
    return out


def parse_engine_info(source: Union[str, os.PathLike, Dict[str, Any]],
                      onnx_nodes: Optional[Iterable[str]] = None) -> List[TrtLayer]:
    """The engine's layers. With ``onnx_nodes`` (the ONNX model's node names) each layer's
    ``onnx_nodes`` holds the ONNX nodes fused into it; without, every part of its name that is
    not an initializer-like dotted name or a TensorRT-internal layer."""
    info = load_engine_info(source)
    known = set(onnx_nodes) if onnx_nodes is not None else None
    layers = []
    for entry in info["Layers"]:
        if isinstance(entry, str):  # profiling verbosity LAYER_NAMES_ONLY
            raise EngineInfoError(f"TensorRT inspector JSON lists layer {entry!r} by name only; "
                                  "what to do: rebuild with --profilingVerbosity=detailed")
        name = str(entry.get("Name", ""))
        weights = entry.get("Weights")
        layer = TrtLayer(name=name, layer_type=str(entry.get("LayerType", "")),
                         inputs=_tensors(entry, "Inputs"), outputs=_tensors(entry, "Outputs"),
                         parts=fused_names(name), origin=str(entry.get("Origin", "")),
                         weights=trt_dtype(str(weights.get("Type", "")))
                         if isinstance(weights, dict) else None)
        if known is not None:
            layer.onnx_nodes = [p for p in layer.parts if p in known]
        else:
            layer.onnx_nodes = [p for p in layer.parts
                                if not _INTERNAL.search(p) and not re.search(r"\.\w+$", p)]
        layers.append(layer)
    return layers


def by_onnx_node(layers: List[TrtLayer]) -> Dict[str, TrtLayer]:
    """ONNX node name -> the engine layer it was fused into."""
    return {node: layer for layer in layers for node in layer.onnx_nodes}


def precision_boundaries(layers: List[TrtLayer]) -> List[TrtLayer]:
    """The reformat layers that change the data type (e.g. FP32 -> FP16 at the input)."""
    return [layer for layer in layers if layer.boundary]


def apply_engine_info(layers: List[Any], source: Union[str, os.PathLike, Dict[str, Any]]
                      ) -> List[TrtLayer]:
    """Fill ``actual`` of precision-report rows (``LayerPrecision``) from inspector JSON.

    Each ONNX node is looked up among the engine layers' fused names; its actual precision is
    the type that layer computes in. A node found in no layer is noted (fused away or
    removed); a plan that disagrees with the engine marks the row as a fallback; a type
    boundary TensorRT inserted next to the node's layer is noted on it. Returns the parsed
    engine layers.
    """
    engine = parse_engine_info(source, [row.onnx_node for row in layers])
    hits = by_onnx_node(engine)
    edges: Dict[str, List[str]] = {}
    for reformat in precision_boundaries(engine):
        target = reformat.for_layer
        if target:
            src, dst = reformat.boundary  # type: ignore[misc]
            edges.setdefault(target, []).append(f"TensorRT reformats {src}->{dst} at "
                                                f"'{reformat.name}'")
    for row in layers:
        hit = hits.get(row.onnx_node)
        if hit is None:
            row.note = (row.note + " not found among TensorRT layers (fused or "
                        "removed)").strip()
            continue
        row.actual = hit.precision
        notes = [] if len(hit.onnx_nodes) == 1 else [f"fused into TensorRT layer '{hit.name}'"]
        notes += edges.get(hit.name, [])
        if row.planned and row.actual and row.actual != row.planned:
            row.fallback = True
            notes.append(f"TensorRT layer '{hit.name}' reads {row.actual}")
        if notes:
            row.note = (row.note + " " + "; ".join(notes)).strip()
    return engine
