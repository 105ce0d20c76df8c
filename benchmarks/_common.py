"""Shared helpers for the fxamp benchmarks: models, machine header, docs appending."""
from __future__ import annotations

import datetime
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"


class GPTBlock(nn.Module):
    """A pre-norm GPT-ish block: LayerNorm, QKV Linear, matmul, softmax, matmul, MLP."""

    def __init__(self, dim: int = 128, heads: int = 4, mlp: int = 512) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.reshape(b, t, h, d // h).transpose(1, 2)
        k = k.reshape(b, t, h, d // h).transpose(1, 2)
        v = v.reshape(b, t, h, d // h).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h)
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[GPTBlock(dim) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.emb(idx))))


class Encoder(nn.Module):
    """nn.TransformerEncoder (batch_first) over random embeddings, mean-pooled, Linear head."""

    def __init__(self, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(dim=1))


def small_vit(image_size: int = 64) -> nn.Module:
    import torchvision
    return torchvision.models.VisionTransformer(
        image_size=image_size, patch_size=16, num_layers=4, num_heads=4, hidden_dim=128,
        mlp_dim=256, num_classes=10)


def models(batch: int = 4, size: int = 64) -> Dict[str, Tuple[Callable[[], nn.Module], tuple]]:
    """name -> (constructor, example inputs)."""
    import torchvision
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    from torchvision.models.swin_transformer import SwinTransformer

    img = (torch.randn(batch, 3, size, size),)
    return {
        "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), img),
        "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
                               img),
        "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(num_classes=10), img),
        "vit_small(4L,128d)": (lambda: small_vit(size), img),
        "convnext_small_cfg": (lambda: ConvNeXt([CNBlockConfig(32, 64, 2),
                                                 CNBlockConfig(64, 128, 2),
                                                 CNBlockConfig(128, None, 2)],
                                                num_classes=10), img),
        "swin_small_cfg": (lambda: SwinTransformer(patch_size=[4, 4], embed_dim=32,
                                                   depths=[2, 2], num_heads=[2, 4],
                                                   window_size=[4, 4], num_classes=10), img),
        "TransformerEncoder(2L,128d)": (lambda: Encoder(), (torch.randn(batch, 32, 128),)),
        "GPT(2 blocks,128d)": (lambda: GPT(), (torch.randint(0, 512, (batch, 32)),)),
    }


def machine() -> str:
    model = platform.processor() or "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        if m:
            model = m.group(1).strip()
    except Exception:  # noqa: BLE001
        pass
    return (f"{model}, {os.cpu_count()} logical cores (torch threads: "
            f"{torch.get_num_threads()}), torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def _cpu_flags() -> Optional[set]:
    """The CPU flags of /proc/cpuinfo (Linux), or None where the system has none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_bf16() -> str:
    """The CPU's bf16 support, printed with every table: the kernel capability torch uses
    (``ATEN_CPU_CAPABILITY`` can lower it), whether oneDNN runs bf16 natively
    (``ONEDNN_MAX_CPU_ISA`` can turn that off) and the avx512_bf16 / amx_bf16 CPU flags."""
    flags = _cpu_flags()

    def flag(name: str) -> str:
        return "?" if flags is None else ("yes" if name in flags else "no")

    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    onednn = "?" if probe is None else ("yes" if probe() else "no")
    return (f"CPU bf16: torch capability {capability}, oneDNN bf16 {onednn}, "
            f"avx512_bf16 {flag('avx512_bf16')}, amx_bf16 {flag('amx_bf16')}")


def command() -> str:
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def append_docs(title: str, body: str, notes: str = "") -> None:
    """Append a dated section to docs/benchmarks.md."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    DOCS.parent.mkdir(exist_ok=True)
    if not DOCS.exists():
        DOCS.write_text("# fxamp benchmarks\n\nSections are appended by the scripts in "
                        "`benchmarks/` (newest last). Numbers are from the machine named in "
                        "each section; see the notes on noise.\n")
    text = (f"\n## {title} ({date})\n\n- machine: {machine()}\n- command: `{command()}`\n\n"
            f"{body}\n")
    if notes:
        text += f"\n{notes}\n"
    with DOCS.open("a") as f:
        f.write(text)


def table(headers, rows) -> str:
    """A markdown table, below a line naming the CPU's bf16 support (:func:`cpu_bf16`)."""
    out = [cpu_bf16(), "", "| " + " | ".join(headers) + " |",
           "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


class _QKV(nn.Module):
    """One LayerNorm output feeding three Linear layers (q, k, v) and two matmuls."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h)


class _SDPA(nn.Module):
    """One FP32 value used as q, k and v of scaled_dot_product_attention."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return F.scaled_dot_product_attention(h, h, h)


class _Inplace(nn.Module):
    """An FP32 value used by two Linear layers before and after an in-place change."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a, self.b, self.ln = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        y = self.a(h)
        h.mul_(2)
        return y + self.b(h) + self.a(h)


class _Tied(nn.Module):
    """Embedding weight reused as the output projection (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.lin = nn.Embedding(100, 32), nn.Linear(32, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(self.lin(self.e(idx)), self.e.weight)


class _MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x, x, x)[0]


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.LSTM(32, 32, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x)[0]


def patterns() -> Dict[str, Tuple[Callable[[], nn.Module], tuple]]:
    """Small graphs with the cast patterns where fxamp and autocast can differ."""
    x = (torch.randn(2, 8, 32),)
    return {
        "pattern: LN -> q,k,v Linear": (_QKV, x),
        "pattern: LN -> SDPA(h,h,h)": (_SDPA, x),
        "pattern: reuse across in-place op": (_Inplace, x),
        "pattern: tied embedding/head": (_Tied, (torch.randint(0, 100, (2, 8)),)),
        "pattern: nn.MultiheadAttention": (_MHA, x),
        "pattern: nn.LSTM": (_LSTM, x),
    }
