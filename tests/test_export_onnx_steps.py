"""The ONNX stage's steps (``fxamp/export/onnx_passes.py``): the files they write are the ones
the fixed sequence of post-processing calls wrote before the steps were declared as a list,
byte for byte (the graph without its metadata, every initializer, the per-step counts in the
file's metadata), on a CNN with BatchNorm (both exporters: the TorchScript file's weights
changed since, on purpose, see ``EXPECTED``), a transformer block, an LSTM and a
hand-written RMSNorm whose eps the optimizer deletes; and the step list in
``docs/architecture.md`` is ``ONNX_STEPS``."""
from __future__ import annotations

import collections
import hashlib
import pathlib
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import onnx

import fxamp
from fxamp.export import export_onnx

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64, eps=1e-12)
        self.qkv = nn.Linear(64, 192)
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-2, -1) / 8.0, dim=-1)
        return x + self.proj(attn @ v)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class RMSHead(nn.Module):
    """A 128x128 weight (over onnxscript's 8192-element fold limit) and an eps of 1e-12."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-12)


def make(kind: str) -> Tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    if kind.startswith("cnn"):
        model = CNN()
        with torch.no_grad():
            for bn in (model.bn, model.bn2):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.2, 0.2)
        return model.eval(), (torch.randn(2, 3, 8, 8),)
    if kind == "block":
        return Block().eval(), (torch.randn(2, 5, 64),)
    if kind == "lstm":
        return Recurrent().eval(), (torch.randn(2, 5, 8),)
    x = torch.randn(3, 128)
    x[1] = 0.0
    return RMSHead().eval(), (x,)


#: the counts each file's metadata holds (and the exporter that made it)
COUNTS = ("fxamp.folded_weight_casts", "fxamp.restored_eps_adds",
          "fxamp.repaired_initializers", "fxamp.eps_fixed", "fxamp.folded_batchnorms",
          "fxamp.removed_casts", "fxamp.exporter")


def fingerprint(path: str) -> Dict[str, Any]:
    """The file's op counts, its counts metadata, a hash of its initializers (name, type,
    shape, bytes) and a hash of its graph without any metadata_props or doc strings (those
    hold the exporter's stack traces, which name source files)."""
    proto = onnx.load(path)
    inits = hashlib.sha256()
    for init in sorted(proto.graph.initializer, key=lambda i: i.name):
        array = onnx.numpy_helper.to_array(init)
        inits.update(f"{init.name}|{init.data_type}|{list(init.dims)}|".encode())
        inits.update(array.tobytes())
    graph = onnx.GraphProto()
    graph.CopyFrom(proto.graph)
    for node in graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        del value.metadata_props[:]
        value.doc_string = ""
    del graph.metadata_props[:]
    graph.doc_string = ""
    meta = {p.key: p.value for p in proto.metadata_props}
    return {"ops": dict(sorted(collections.Counter(n.op_type for n in graph.node).items())),
            "counts": tuple(meta[k] for k in COUNTS),
            "initializers": inits.hexdigest()[:16],
            "graph": hashlib.sha256(graph.SerializeToString(deterministic=True)).hexdigest()[:16]}


def export(kind: str, tmp_path: pathlib.Path) -> str:
    model, inputs = make(kind)
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda"))
    exporter = "torchscript" if kind.endswith("torchscript") else "dynamo"
    return export_onnx(gm, inputs, str(tmp_path / f"{kind}.onnx"), exporter=exporter)


#: recorded from the fixed sequence of calls the steps replaced (torch 2.14.1, onnx and
#: onnxscript of the test extra, on CPU)
EXPECTED: Dict[str, Dict[str, Any]] = {
    # changed on purpose since: the BatchNorms are folded in the exporter's view
    # (export/weight_view.py), so the folded weights and biases are named after the Conv's
    # weight and pass through the weight-cast fold (3 -> 7 folded casts); their values are the
    # ONNX fold's bit for bit (the same ops, the same initializer bytes under other names)
    "cnn": {
        "ops": {"Cast": 2, "Conv": 2, "Gemm": 1, "ReduceMean": 1, "Relu": 2},
        "counts": ("7", "0", "0", "0", "2", "0", "dynamo"),
        "initializers": "65c293b3a0f5b526", "graph": "cdfbd5915105799c"},
    # changed on purpose since: the TorchScript exporter's constant folding is off, so its
    # BatchNorm fold reads the FP32 weights (the same ops; 2 weight casts folded by fxamp)
    "cnn_torchscript": {
        "ops": {"Cast": 2, "Constant": 1, "Conv": 2, "Gemm": 1, "ReduceMean": 1, "Relu": 2},
        "counts": ("2", "0", "0", "0", "2", "0", "torchscript"),
        "initializers": "3460588570ee7bd6", "graph": "136f9c887edbe82b"},
    "block": {
        "ops": {"Add": 3, "Cast": 4, "Div": 1, "LayerNormalization": 1, "MatMul": 4,
                "Softmax": 1, "Split": 1, "Transpose": 1},
        "counts": ("5", "0", "0", "0", "0", "0", "dynamo"),
        "initializers": "21385e9648dbcc6f", "graph": "bc9c01cc117801a1"},
    "lstm": {
        "ops": {"Gather": 1, "Gemm": 1, "LSTM": 1, "Reshape": 1, "Transpose": 3},
        "counts": ("7", "0", "2", "0", "0", "0", "dynamo"),
        "initializers": "0f414420c80ced1a", "graph": "5528394fa27c865e"},
    "rms": {
        "ops": {"Add": 1, "Cast": 2, "Gemm": 1, "Mul": 1, "Pow": 1, "Reciprocal": 1,
                "ReduceMean": 1, "Sqrt": 1},
        "counts": ("2", "1", "0", "0", "0", "0", "dynamo"),
        "initializers": "a30bffd9540ddf7f", "graph": "4043258a06aff4ad"},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_onnx_steps_write_the_same_file_as_before(kind, tmp_path):
    assert fingerprint(export(kind, tmp_path)) == EXPECTED[kind]


def documented_steps() -> list:
    """(step, what) of each row of the table in docs/architecture.md, "The ONNX stage"."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## The ONNX stage\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows.append((cells[1].strip("`"), cells[4]))
    return rows


def test_architecture_page_lists_the_onnx_steps_in_order():
    from fxamp.export.onnx_passes import ONNX_STEPS

    assert documented_steps() == [(step.name, step.what) for step in ONNX_STEPS]
