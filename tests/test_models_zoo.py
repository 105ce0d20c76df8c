"""Real models (random weights, tiny configs) through ``amp_rewrite`` (front end "auto").

Hugging Face BERT, GPT-2, LLaMA and T5 (keyword inputs with an attention mask, ModelOutput
results), a timm model that ``torch.fx.symbolic_trace`` cannot take, a torchvision detection
model (a list of images in, a list of dicts out) and a hand-written model that branches on a
tensor value. For each: the front end the plan header records, the output against the FP32
model, and for the trainable ones three SGD steps on the rewritten model.

Nothing is downloaded: every model is built from a config or with ``weights=None``.

Tolerance (``REL_TOL``): the outputs are compared as max |rewritten - FP32| divided by
max |FP32| over the floating output leaves. bfloat16 keeps 8 significant bits, so one
rounding is off by at most 2**-9 ~ 2e-3 relative; a 2-layer transformer or a small CNN puts
some tens of roundings (casts of activations and weights, bf16 matmul outputs) on the path
to an output, and they partly cancel, so errors of ~1e-2 of the output's scale are what bf16
compute gives (benchmarks/coverage.py measures 5e-3 to 2e-2 on torchvision CNNs). 5e-2 leaves
a margin over that, and it is still far below what a wrong decision gives: a dropped
attention mask, a missing cast or a wrong branch moves the output by O(1) of its scale
(the attention-mask tests check that the mask moves the output by more than the tolerance).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")           # never reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from typing import Any, Dict  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxamp  # noqa: E402
from fxamp.passes.annotate import float_leaves  # noqa: E402

REL_TOL = 5e-2
SEQ = 8
pytestmark = pytest.mark.slow  # transformers / timm / torchvision model zoos


def rel_error(ref: Any, got: Any) -> float:
    a, b = float_leaves(ref), float_leaves(got)
    assert len(a) == len(b) and a, (len(a), len(b))
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
        assert torch.isfinite(y).all()
    scale = max(float(x.abs().max()) for x in a)
    return max(float((y.float() - x).abs().max()) for x, y in zip(a, b)) / scale


def rewrite(model: nn.Module, args: tuple = (), kwargs: Dict[str, Any] = None):
    return fxamp.amp_rewrite(model, args,
                             fxamp.RewriteConfig.make(example_kwargs=kwargs, dtype=torch.bfloat16,
                                                      target="cpu",
                                                      frontend="auto"))


def tokens(vocab: int = 1000):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :3] = 0        # the second sequence starts with 3 padding tokens (left padding:
    return ids, mask       # in a causal model the real tokens then see the mask)


def check_close_and_masked(model: nn.Module, gm: nn.Module, kwargs: Dict[str, Any],
                           key: str) -> None:
    """The rewritten model is within REL_TOL of FP32, and the attention mask is honoured:
    without it the FP32 output moves by more than the tolerance."""
    model.eval()
    gm.eval()
    with torch.no_grad():
        ref = model(**kwargs)
        got = gm(**kwargs)
        unmasked = model(**{k: v for k, v in kwargs.items() if k != "attention_mask"})
    assert type(got) is type(ref)               # the ModelOutput class comes back
    assert rel_error(ref, got) < REL_TOL
    assert rel_error(ref[key], unmasked[key]) > 2 * REL_TOL


def train_steps(model: nn.Module, gm: nn.Module, batch: Dict[str, Any], loss_of,
                steps: int = 3) -> None:
    """Three plain-SGD steps on the rewritten model (bf16 compute, FP32 master weights):
    the loss stays finite, the parameters change, and they are the model's own objects."""
    own = {id(p) for p in model.parameters()}
    gm_params = list(gm.parameters())
    assert gm_params and all(id(p) in own for p in gm_params)
    before = {id(p): p.detach().clone() for p in gm_params}
    gm.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(gm(**batch) if isinstance(batch, dict) else gm(*batch))
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        loss.backward()
        opt.step()
    grads = [p for p in gm_params if p.grad is not None]
    assert grads and all(p.grad.dtype == torch.float32 for p in grads)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # an SGD step can leave a weight unchanged only where lr * grad is below its FP32 spacing
    nonzero = [p for p in grads if p.grad.abs().max() > 0]
    changed = [p for p in nonzero if not torch.equal(p.detach(), before[id(p)])]
    assert nonzero and len(changed) >= 0.9 * len(nonzero)
    after = list(gm.parameters())
    assert len(after) == len(gm_params) and all(p is q for p, q in zip(after, gm_params))


# ---------------------------------------------------------------------------------------
# Hugging Face
# ---------------------------------------------------------------------------------------
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=128, vocab_size=1000)


def test_bert_attention_mask_and_training():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    # initializer_range 0.2, not BERT's 0.02: with weights that small the attention is almost
    # uniform and the mask moves the logits by <1e-2, too little to show it is honoured
    model = BertForSequenceClassification(BertConfig(**SMALL, num_labels=3,
                                                     initializer_range=0.2))
    ids, mask = tokens()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    model.eval()
    gm = rewrite(model, (), kwargs)
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    check_close_and_masked(model, gm, kwargs, "logits")
    # the same rewritten model trains: gm.train() switches dropout on, as in the model
    labels = torch.tensor([0, 2])
    train_steps(model, gm, kwargs, lambda out: F.cross_entropy(out.logits, labels))


def test_gpt2_lm_loss_and_training():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=32,
                                       vocab_size=1000, use_cache=False,
                                       bos_token_id=0, eos_token_id=0))
    ids, mask = tokens()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    model.eval()
    gm = rewrite(model, (), kwargs)
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    check_close_and_masked(model, gm, kwargs, "logits")
    # the loss computed inside the model (labels=): Hugging Face's own loss path, which
    # upcasts the logits with .float() before the cross entropy
    batch = {**kwargs, "labels": ids}
    gm_t = rewrite(model.train(), (), batch)
    train_steps(model, gm_t, batch, lambda out: out.loss)


def test_llama_causal_lm():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=1,
                                         max_position_embeddings=32, use_cache=False)).eval()
    ids, mask = tokens()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    gm = rewrite(model, (), kwargs)
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    check_close_and_masked(model, gm, kwargs, "logits")


def test_t5_encoder_decoder():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(
        d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2,
        vocab_size=1000, use_cache=False)).eval()
    ids, mask = tokens()
    kwargs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :4]}
    gm = rewrite(model, (), kwargs)
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    check_close_and_masked(model, gm, kwargs, "logits")


# ---------------------------------------------------------------------------------------
# timm, torchvision detection
# ---------------------------------------------------------------------------------------
def test_timm_model_symbolic_trace_cannot_take():
    import timm
    torch.manual_seed(0)
    # CrossViT: its two branches see the image at 240 and 224 (scale_image branches on the
    # input's size, which torch.fx cannot trace); shrunk to one block and 32/64 channels.
    # (TinyViT, another such model, spends ~90 s in amp_rewrite's export on this machine.)
    model = timm.create_model("crossvit_tiny_240", pretrained=False, embed_dim=(32, 64),
                              depth=((1, 1, 0),), num_heads=(2, 2), num_classes=10).eval()
    with pytest.raises(torch.fx.proxy.TraceError):   # the reason this model is here
        torch.fx.symbolic_trace(model)
    x = torch.randn(2, 3, 240, 240)
    gm = rewrite(model, (x,))
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    with torch.no_grad():
        assert rel_error(model(x), gm.eval()(x)) < REL_TOL


def test_torchvision_detection_list_of_images():
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64,
        box_score_thresh=0.0).eval()
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    gm = rewrite(model, (images,))
    # GeneralizedRCNN.forward loops over the list of images and branches on sizes: no tracer
    # takes the root, so it runs eagerly with its children (backbone, rpn, roi_heads)
    # rewritten
    header = fxamp.plan_of(gm).header
    assert header["frontend"] == "eager"
    with torch.no_grad():
        ref = model(images)
        got = gm.eval()(images)
    assert isinstance(got, list) and len(got) == 2
    for r, g in zip(ref, got):
        assert set(g) == {"boxes", "labels", "scores"}
        assert g["boxes"].dtype == torch.float32 and g["scores"].dtype == torch.float32
        assert torch.isfinite(g["boxes"]).all() and torch.isfinite(g["scores"]).all()
        assert (g["boxes"] >= 0).all() and (g["boxes"] <= 64).all()    # clipped to the image
        assert ((g["labels"] >= 1) & (g["labels"] < 3)).all()
        # which boxes survive NMS can flip when bf16 moves nearly equal scores, so compare
        # the best score per image (a softmax probability: bf16 logits move it by ~1e-2)
        assert len(g["scores"]) and len(r["scores"])
        assert abs(float(g["scores"].max()) - float(r["scores"].max())) < REL_TOL
    # show and audit read the eager result: its rewritten children's graphs, with the parts
    # that run under autocast (the transform, the anchor generator, the RoI pooler) marked
    from fxamp.passes.audit.results import audit_result
    from fxamp.show import shown_nodes
    plan = fxamp.plan_of(gm)
    drawn = {n.name: n for n in shown_nodes(gm, plan)}
    assert any(name.startswith("backbone/") for name in drawn)
    assert drawn["transform"].rule == "runtime"
    findings = audit_result(gm, fxamp.result.result_of(gm).policy)
    runtime = {f.node for f in findings if f.code == "runs-under-autocast"}
    assert "transform" in runtime and "rpn/anchor_generator" in runtime
    assert any(f.code == "dims-not-multiple-of-8" and "/" in f.node for f in findings)


# ---------------------------------------------------------------------------------------
# hand-written: a branch on a tensor value
# ---------------------------------------------------------------------------------------
class SignGate(nn.Module):
    """Python control flow on a tensor value: neither torch.fx nor torch.export can take it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return torch.relu(x) * 2.0
        return torch.tanh(x) - 1.0


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.gate = SignGate()
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.gate(self.fc1(x))))


def test_handwritten_data_dependent_branch():
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(8, 16)
    gm = rewrite(model, (x,))
    plan = fxamp.plan_of(gm)
    assert plan.header["frontend"] == "fx+runtime"
    assert plan.header.get("runtime leaves") == "gate"
    assert plan.nodes["gate"].rule == "runtime"
    assert plan.nodes["fc1"].dtype == torch.bfloat16      # linear: CPU autocast's bf16 list
    # both branches: the branch is taken at run time on each input, not frozen at trace
    # time. u is the gradient of fc1(x).sum() w.r.t. each row, so x +- 10 u/|u| moves the sum
    # by +-80|u| and picks the branch
    u = model.fc1.weight.detach().sum(0)
    inputs = [x, -x, x + 10 * u / u.norm(), x - 10 * u / u.norm()]
    with torch.no_grad():
        signs = {float(model.fc1(inp).sum()) > 0 for inp in inputs}
    assert signs == {True, False}
    with torch.no_grad():
        for inp in inputs:
            assert rel_error(model(inp), gm(inp)) < REL_TOL
    target = torch.randn(8, 4)
    train_steps(model, gm, (x,), lambda out: ((out - target) ** 2).mean())
