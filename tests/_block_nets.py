"""Models the block-mode tests share: a residual MLP block, a net of identical blocks
between a stem and a head (the glue), blocks calling a module they hold outside the tree,
a tiny HF Llama, a counter of the blocks fxamp plans with a trace of their own, and a copy
by deepcopy or pickle. ``make`` is a CLI factory (``tests/_block_nets.py:make``)."""
from __future__ import annotations

import contextlib
import copy
import io
import logging
from typing import Iterator, Optional

import torch
import torch.nn as nn


class Block(nn.Module):
    """A residual MLP: 8 -> 16 -> 8."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """``blocks`` identical :class:`Block` s in a ModuleList between a stem and a head."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Holding(nn.Module):
    """A block that calls a module it holds in a plain list (not registered)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = [shared]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.extra[0](x)


class Holds(nn.Module):
    """Two :class:`Holding` blocks sharing the root's ``aux`` Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Holding(self.aux), Holding(self.aux)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class InFp32(nn.Module):
    """``inner`` computed in FP32 under autocast: the reference for an ``fp32:`` override
    of it (its outputs in the dtypes its FP32 code gives)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor):
        with torch.autocast("cpu", enabled=False):
            return self.inner(x.float())


def copied(model: nn.Module, how: str) -> nn.Module:
    """``model`` copied by ``copy.deepcopy`` (``how="deepcopy"``) or saved and loaded with
    ``torch.save`` / ``torch.load`` (``"pickle"``)."""
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def make() -> tuple:
    """A CLI factory: a seeded :class:`Net` and its example input."""
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 8),)


def tiny_llama(layers: int = 2) -> nn.Module:
    """A seeded tiny ``LlamaForCausalLM`` (vocabulary 128, hidden 64), without a KV cache."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


class Traces(logging.Handler):
    """Counts the blocks planned with a trace of their own (a block that shares another's
    plan is not traced): of the classes ``only`` names, or of every class when it is
    None."""

    def __init__(self, only: Optional[set] = None) -> None:
        super().__init__(logging.INFO)
        self.count = 0
        self.only = only

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.count += "planning it on this call" in text and (
            self.only is None or text.split(":", 1)[0] in self.only)


@contextlib.contextmanager
def traces(only: Optional[set] = None) -> Iterator[Traces]:
    """Counts the traces of the blocks planned inside (see :class:`Traces`)."""
    counter = Traces(only)
    logger = logging.getLogger("fxamp")
    level = logger.level
    logger.addHandler(counter)
    logger.setLevel(logging.INFO)
    try:
        yield counter
    finally:
        logger.removeHandler(counter)
        logger.setLevel(level)
