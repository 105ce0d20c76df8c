"""The ``metadata_props`` of an ONNX file: the keys fxamp writes and the two helpers that read
and write them (on a node or on the model: both have ``metadata_props``).

Keys on a node: "fxamp.fx_node" (:data:`FX_NODE`, the plan's node name), "fxamp.module"
(:data:`MODULE`), "fxamp.note" (:data:`NOTE`, what a step of the ONNX stage changed at that
node); Model Explorer's node data adds "fxamp.rule" and "fxamp.reason". The exporter's own
keys are read: "pkg.torch.onnx.fx_node" (matched by :data:`FX_NODE_RE`),
"pkg.torch.onnx.name_scopes", "pkg.onnxscript.rewriter.rule_name".
"""
from __future__ import annotations

import re
from typing import Any, Optional

#: a node's plan node (the node name in the rewritten graph)
FX_NODE = "fxamp.fx_node"
#: a node's module path
MODULE = "fxamp.module"
#: what fxamp changed at a node (sentences, appended)
NOTE = "fxamp.note"
#: the exported-program node name at the start of the exporter's "pkg.torch.onnx.fx_node"
FX_NODE_RE = re.compile(r"^%([^\s:]+)")


def set_meta(node: Any, key: str, value: str) -> None:
    """Set ``key`` to ``value`` in ``node.metadata_props`` (replacing an earlier value).

    Args:
        node: an ONNX NodeProto or ModelProto.
        key: the property's key.
        value: its new value.
    """
    for prop in node.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    entry = node.metadata_props.add()
    entry.key, entry.value = key, value


def get_meta(node: Any, key: str) -> Optional[str]:
    """The value of ``key`` in ``node.metadata_props``.

    Args:
        node: an ONNX NodeProto or ModelProto.
        key: the property's key.

    Returns:
        The value, or None when ``node`` has no such property.
    """
    for prop in node.metadata_props:
        if prop.key == key:
            return prop.value
    return None

