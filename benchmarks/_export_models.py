"""Small models for the export benchmarks: real architectures with random weights, sized to
run on two CPU cores in seconds. Each factory returns ``(model in eval mode, example inputs,
a second batch for checking)``."""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

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


def efficientnet_b0() -> Example:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10).eval()
    return model, (torch.randn(1, 3, 64, 64),), (torch.randn(1, 3, 64, 64),)


def mobilenetv3() -> Example:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=10).eval()
    return model, (torch.randn(1, 3, 64, 64),), (torch.randn(1, 3, 64, 64),)


def swin_half() -> Example:
    """A half-width, two-stage Swin (window attention, relative position bias, patch merge)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=64,
                              embed_dim=48, depths=(2, 2), num_heads=(2, 4), window_size=4,
                              num_classes=10).eval()
    return model, (torch.randn(1, 3, 64, 64),), (torch.randn(1, 3, 64, 64),)


class Hidden(nn.Module):
    """A Hugging Face encoder whose forward returns its last hidden state alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, return_dict=False)[0]


def _t5_encoder(ff_scale: float) -> Example:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=512,
                   attn_implementation="eager")
    model = T5EncoderModel(cfg)
    with torch.no_grad():  # a trained T5's feed-forward outputs grow the residual stream
        for block in model.encoder.block:
            block.layer[-1].DenseReluDense.wo.weight.mul_(ff_scale)
    return (Hidden(model).eval(), (torch.randint(0, 512, (1, 16)),),
            (torch.randint(0, 512, (1, 16)),))


def t5_encoder() -> Example:
    """A 2-layer T5 encoder at its initial weight scale (RMSNorm, relative attention bias)."""
    return _t5_encoder(1.0)


def t5_encoder_large() -> Example:
    """The same encoder with feed-forward outputs scaled by 300: the residual stream passes
    FP16's max / 8, as a trained T5's does."""
    return _t5_encoder(300.0)


class Recurrent(nn.Module):
    """A 2-layer LSTM and a GRU over a sequence, classified from the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.gru = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        h, _ = self.gru(h)
        return self.head(h[:, -1])


def lstm_gru() -> Example:
    torch.manual_seed(0)
    return Recurrent().eval(), (torch.randn(2, 10, 16),), (torch.randn(2, 10, 16),)


def _block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """A two-level UNet: Conv-BN-ReLU blocks, max-pool down, transposed-conv up, skip concat."""

    def __init__(self, w: int = 16) -> None:
        super().__init__()
        self.d1, self.d2, self.mid = _block(3, w), _block(w, 2 * w), _block(2 * w, 4 * w)
        self.pool = nn.MaxPool2d(2)
        self.u2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2)
        self.b2 = _block(4 * w, 2 * w)
        self.u1 = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.b1 = _block(2 * w, w)
        self.out = nn.Conv2d(w, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(self.pool(a))
        m = self.mid(self.pool(b))
        b = self.b2(torch.cat([self.u2(m), b], 1))
        return self.out(self.b1(torch.cat([self.u1(b), a], 1)))


def unet() -> Example:
    torch.manual_seed(0)
    model = UNet()
    with torch.no_grad():  # trained-like BatchNorm statistics, so the fold changes weights
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
    return model.eval(), (torch.randn(1, 3, 64, 64),), (torch.randn(1, 3, 64, 64),)


class LargeEmbeddingNorm(nn.Module):
    """A LayerNorm over a scaled embedding sum: at ``scale=1e3`` the activations reach ~5000
    (every one under FP16's max / 8); at 80 they stay under a deployment plan's limit (512),
    while the LayerNorm's squared deviations still pass FP16's max."""

    def __init__(self, scale: float = 1e3) -> None:
        super().__init__()
        self.scale = scale
        self.tok = nn.Embedding(100, 64)
        self.pos = nn.Parameter(torch.randn(16, 64))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm((self.tok(ids) + self.pos) * self.scale))


def norm_large() -> Example:
    torch.manual_seed(0)
    return (LargeEmbeddingNorm().eval(), (torch.randint(0, 100, (2, 16)),),
            (torch.randint(0, 100, (2, 16)),))


class FlatRowsNorm(nn.Module):
    """A LayerNorm with BERT's eps (1e-12) over rows that are constant or nearly so
    (``3 + 1e-4 * x``): their spread is below FP16's spacing at 3, and the eps does not damp
    the norm's division by it. ``offset`` 0 and ``scale`` 1 give ordinary rows.

    Args:
        offset: what every row is near.
        scale: how far its values are from it.
    """

    def __init__(self, offset: float = 3.0, scale: float = 1e-4) -> None:
        super().__init__()
        self.offset, self.scale = offset, scale
        self.up = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64, eps=1e-12)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.offset + self.scale * self.up(x)))


def _flat_batch() -> tuple:
    x = torch.randn(4, 16)
    x[0] = 0.0  # a row the norm sees as exactly 3 + 1e-4 * bias
    return (x,)


def norm_flat() -> Example:
    torch.manual_seed(0)
    return FlatRowsNorm().eval(), _flat_batch(), _flat_batch()


def convnext_atto() -> Example:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10).eval()
    return model, (torch.randn(1, 3, 64, 64),), (torch.randn(1, 3, 64, 64),)


class MaskedEncoder(nn.Module):
    """A Hugging Face encoder called with token ids and a padding mask; its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, return_dict=False)[0]


def distilbert_padded() -> Example:
    """A 2-layer DistilBERT classifier on a padded batch (the mask's large negative fill)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    cfg = DistilBertConfig(n_layers=2, dim=64, n_heads=4, hidden_dim=128, vocab_size=512,
                           max_position_embeddings=32, attn_implementation="eager")
    model = MaskedEncoder(DistilBertForSequenceClassification(cfg)).eval()

    return model, _padded_batch(), _padded_batch()


def t5_encoder_padded() -> Example:
    """The 2-layer T5 encoder called with a padding mask on a padded batch."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=512,
                   attn_implementation="eager")
    return MaskedEncoder(T5EncoderModel(cfg)).eval(), _padded_batch(), _padded_batch()


def _padded_batch() -> tuple:
    """Token ids and a padding mask: the second of two sequences is padded after 10 tokens."""
    ids = torch.randint(0, 512, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    return ids, mask


MODELS: Dict[str, Callable[[], Example]] = {
    "resnet18": resnet18, "vit_tiny": vit_tiny, "gpt2_tiny": gpt2_tiny, "bert_tiny": bert_tiny,
    "act_1e5": activations_1e5, "trap": numerics_trap, "efficientnet_b0": efficientnet_b0,
    "mobilenetv3": mobilenetv3, "swin_half": swin_half, "t5_enc": t5_encoder,
    "t5_enc_x300": t5_encoder_large, "lstm_gru": lstm_gru, "unet": unet,
    "norm_large": norm_large, "norm_flat": norm_flat, "convnext_atto": convnext_atto,
    "distilbert_pad": distilbert_padded, "t5_enc_pad": t5_encoder_padded}


def _image() -> tuple:
    return (torch.randn(1, 3, 64, 64),)


def _ids(vocab: int, batch: int = 1) -> Callable[[], tuple]:
    return lambda: (torch.randint(0, vocab, (batch, 16)),)


def _trap_batch() -> tuple:
    y = torch.randn(4, 16)
    y[1] = -2.0  # a constant row, as in the factory's check batch
    return (y,)


#: one more random batch like each model's check batch (drawn from torch's generator)
BATCHES: Dict[str, Callable[[], tuple]] = {
    "resnet18": _image, "vit_tiny": _image, "gpt2_tiny": _ids(512), "bert_tiny": _ids(512),
    "act_1e5": lambda: (torch.randn(4, 32),), "trap": _trap_batch,
    "efficientnet_b0": _image, "mobilenetv3": _image, "swin_half": _image,
    "t5_enc": _ids(512), "t5_enc_x300": _ids(512),
    "lstm_gru": lambda: (torch.randn(2, 10, 16),), "unet": _image,
    "norm_large": _ids(100, 2), "norm_flat": _flat_batch, "convnext_atto": _image,
    "distilbert_pad": _padded_batch, "t5_enc_pad": _padded_batch}


def check_batches(name: str, check: tuple, count: int = 8) -> List[tuple]:
    """``count`` batches to measure a file's error on: the factory's own ``check`` batch, then
    ``count - 1`` more like it, drawn from a fixed seed (the same for every tool). One
    batch's max error swings 2-4x from batch to batch; a mean over 8 is the statistic."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    try:
        return [check] + [BATCHES[name]() for _ in range(count - 1)]
    finally:
        torch.random.set_rng_state(gen_state)


# -- real sizes (export_peers.py --real): random weights, the issue "Deployment at real sizes"
class _Seq2Seq(nn.Module):
    """T5: the encoder's and the decoder's ids in, the decoder's last hidden state out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=dec, return_dict=False)[0]


def gpt2_small() -> Tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return LogitsOnly(GPT2LMHeadModel(GPT2Config())).eval(), \
        (torch.randint(0, 50257, (2, 128)),)


def bert_base() -> Tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return LogitsOnly(BertModel(BertConfig())).eval(), (torch.randint(0, 30522, (2, 128)),)


def vit_b16() -> Tuple[nn.Module, tuple]:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.vit_b_16().eval(), (torch.randn(1, 3, 224, 224),)


def resnet50() -> Tuple[nn.Module, tuple]:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50().eval(), (torch.randn(1, 3, 224, 224),)


def t5_small() -> Tuple[nn.Module, tuple]:
    from transformers import T5Config, T5Model

    torch.manual_seed(0)
    return _Seq2Seq(T5Model(T5Config())).eval(), (torch.randint(0, 32128, (2, 128)),
                                                  torch.randint(0, 32128, (2, 128)))


#: real-size models (``(model, example)``), slow: benchmarks/export_peers.py --real
REAL_MODELS: Dict[str, Callable[[], Tuple[nn.Module, tuple]]] = {
    "gpt2_small": gpt2_small, "bert_base": bert_base, "vit_b16": vit_b16,
    "resnet50": resnet50, "t5_small": t5_small}
