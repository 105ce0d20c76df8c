"""Small models for the export benchmarks: real architectures with random weights, sized to
run on two CPU cores in seconds. Each factory returns ``(model in eval mode, example inputs,
a second batch for checking)``."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn

Example = Tuple[nn.Module, tuple, tuple]


class LogitsOnly(nn.Module):
    """A Hugging Face model whose forward returns its first output (the logits) alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, return_dict=False)[0]


def resnet18() -> Example:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    return model, (torch.randn(1, 3, 64, 64),), (torch.randn(1, 3, 64, 64),)


def vit_tiny() -> Example:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64,
                              num_classes=10).eval()
    return model, (torch.randn(1, 3, 64, 64),), (torch.randn(1, 3, 64, 64),)


def gpt2_tiny() -> Example:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32,
                     attn_implementation="eager")
    model = LogitsOnly(GPT2LMHeadModel(cfg)).eval()
    return model, (torch.randint(0, 512, (1, 16)),), (torch.randint(0, 512, (1, 16)),)


def bert_tiny() -> Example:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                     intermediate_size=128, vocab_size=512, max_position_embeddings=32,
                     attn_implementation="eager")
    model = LogitsOnly(BertForSequenceClassification(cfg)).eval()
    return model, (torch.randint(0, 512, (1, 16)),), (torch.randint(0, 512, (1, 16)),)


class LargeActivations(nn.Module):
    """Activations near 1e5 (past FP16's 65504) before a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.up(x) * 5e4)))


def activations_1e5() -> Example:
    torch.manual_seed(0)
    return LargeActivations().eval(), (torch.randn(4, 32),), (torch.randn(4, 32),)


class NumericsTrap(nn.Module):
    """A hand-written softmax whose exp sum overflows FP16, and a hand-written norm with
    eps 1e-12 that a constant row turns into 0 * inf in FP16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x - x.mean(-1, keepdim=True)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-12)
        h = self.proj(z) * 4.0
        p = torch.exp(h) / torch.exp(h).sum(-1, keepdim=True)
        return self.head(p)


def numerics_trap() -> Example:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    x[0] = 0.5  # a constant row: its centred values are 0
    y = torch.randn(4, 16)
    y[1] = -2.0
    return NumericsTrap().eval(), (x,), (y,)


MODELS: Dict[str, Callable[[], Example]] = {
    "resnet18": resnet18, "vit_tiny": vit_tiny, "gpt2_tiny": gpt2_tiny, "bert_tiny": bert_tiny,
    "act_1e5": activations_1e5, "trap": numerics_trap}
