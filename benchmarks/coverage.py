"""Model coverage of ``fxamp.amp_rewrite``: which real models it takes, through which front end.

Every model is built with random weights (nothing is downloaded), rewritten with
``amp_rewrite(model, args, RewriteConfig.make(example_kwargs=kwargs, dtype=torch.bfloat16,
target="cpu"))`` and run next to the FP32 model on the same input in eval mode. Each model
runs in its own subprocess with a time limit, so one crash or hang does not stop the table.

Models: every torchvision classification, segmentation and detection model, a sample of
timm models across families, and Hugging Face models built from small configs (caches off).

    python benchmarks/coverage.py                      # everything, print a markdown table
    python benchmarks/coverage.py --only resnet        # names containing "resnet" (regex)
    python benchmarks/coverage.py --limit 5            # the first 5 models
    python benchmarks/coverage.py --write              # regenerate docs/coverage.md

Columns: family, model, the front end that took it (``plan_of(gm).header["frontend"]``),
the number of nodes in the rewritten graph (``len(gm.graph.nodes)``), the rewrite time
(wall seconds, ``amp_rewrite`` only), the output error (max abs error over all floating
output leaves divided by the max abs value of the FP32 output's floating leaves) and the
failure (exception type and first line) if any.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import inspect
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # random weights only: never the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "coverage.md"
MARK = "@@COVERAGE@@ "
BATCH = 2
SEQ = 16

# ---------------------------------------------------------------------------------------
# the models
# ---------------------------------------------------------------------------------------
#: models left out of the run, with the reason (listed in docs/coverage.md)
EXCLUDED = {
    "torchvision/vit_h_14": "632M parameters at a fixed 224x224 input (~167 GFLOPs per image): "
                            "left out up front as too big for 2 shared CPU cores within the "
                            "per-model time limit (random init, FP32 reference, rewrite and "
                            "rewritten forward); not measured",
    "torchvision/regnet_y_128gf": "645M parameters (~128 GFLOPs per 224x224 image): left out "
                                  "up front for the same reason; not measured",
}

#: torchvision classification models whose input size is fixed or has a minimum above 64
_TV_SIZE = {
    "inception_v3": 75 + 5,        # three stride-2 stages and valid convolutions: 75x75 minimum
    "maxvit_t": 224,               # window/grid partition sizes are tied to 224
}
_TV_VIT = re.compile(r"^vit_")     # torchvision ViTs check the image size equals image_size


def _tv_classification() -> Dict[str, Tuple[str, Callable]]:
    import torchvision
    out = {}
    for name in torchvision.models.list_models(module=torchvision.models):
        size = 224 if _TV_VIT.match(name) else _TV_SIZE.get(name, 64)
        out[f"torchvision/{name}"] = ("torchvision classification",
                                      lambda name=name, size=size: _tv_cls(name, size))
    return out


def _tv_cls(name: str, size: int):
    import torch
    import torchvision
    kw = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") \
        else {}
    model = torchvision.models.get_model(name, weights=None, **kw)
    note = f"{size}x{size}" + (", aux_logits=False, init_weights=False" if kw else "")
    return model, (torch.randn(BATCH, 3, size, size),), {}, note


def _tv_segmentation() -> Dict[str, Tuple[str, Callable]]:
    import torchvision
    out = {}
    for name in torchvision.models.list_models(module=torchvision.models.segmentation):
        out[f"torchvision/{name}"] = ("torchvision segmentation",
                                      lambda name=name: _tv_seg(name))
    return out


def _tv_seg(name: str):
    import torch
    import torchvision
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None)
    return model, (torch.randn(BATCH, 3, 64, 64),), {}, "64x64"


def _tv_detection() -> Dict[str, Tuple[str, Callable]]:
    import torchvision
    out = {}
    for name in torchvision.models.list_models(module=torchvision.models.detection):
        out[f"torchvision/{name}"] = ("torchvision detection", lambda name=name: _tv_det(name))
    return out


def _tv_det(name: str):
    import torch
    import torchvision
    kw: Dict[str, Any] = {}
    note = "list of 2 images 3x64x64"
    if not name.startswith("ssd"):
        # the R-CNNs, RetinaNet and FCOS resize images to min_size (800 by default);
        # 64 keeps the images at 64x64 so the run stays short on a CPU
        kw = {"min_size": 64, "max_size": 64}
        note += ", min_size=max_size=64"
    else:
        note += " (resized to the model's fixed 300/320)"
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, **kw)
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    return model, (images,), {}, note


#: a sample of timm models across families; each entry: (name, image size, note)
TIMM = [
    ("resnet18", 64, ""),
    ("efficientnet_b0", 64, ""),
    ("convnext_atto", 64, ""),
    ("vit_tiny_patch16_224", 224, "fixed 224 (position embeddings)"),
    ("deit_tiny_distilled_patch16_224", 224, "two heads; averages them in eval"),
    ("swin_tiny_patch4_window7_224", 224, "fixed 224 (window attention)"),
    ("maxvit_nano_rw_256", 256, "fixed 256 (window/grid attention)"),
    ("regnetx_002", 64, ""),
    ("mobilenetv3_small_100", 64, ""),
    ("levit_128s", 224, "fixed 224 (attention biases)"),
    ("coatnet_nano_rw_224", 224, "fixed 224"),
    ("beit_base_patch16_224", 224, "fixed 224 (relative position bias)"),
    ("mixer_s16_224", 224, "fixed 224 (token-mixing MLP)"),
    ("convmixer_768_32", 64, ""),
    ("edgenext_xx_small", 64, ""),
    ("efficientformer_l1", 224, "fixed 224 (attention biases)"),
    ("pit_ti_224", 224, "fixed 224"),
    ("poolformer_s12", 64, ""),
    # torch.fx.symbolic_trace cannot take these (Python control flow on traced values)
    ("mobilevit_xxs", 64, "fx cannot trace it"),
    ("efficientvit_b0", 64, "fx cannot trace it"),
    ("tiny_vit_5m_224", 64, "fx cannot trace it"),
    ("crossvit_tiny_240", 240, "fixed 240; fx cannot trace it"),
    ("twins_svt_small", 64, "fx cannot trace it"),
]


def _timm() -> Dict[str, Tuple[str, Callable]]:
    return {f"timm/{name}": ("timm", lambda name=name, size=size, note=note:
                             _timm_one(name, size, note)) for name, size, note in TIMM}


def _timm_one(name: str, size: int, note: str):
    import timm
    import torch
    model = timm.create_model(name, pretrained=False)
    return model, (torch.randn(BATCH, 3, size, size),), {}, \
        f"{size}x{size}" + (f"; {note}" if note else "")


def _tokens(vocab: int = 1000):
    import torch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0                     # the second sequence ends in 4 padding tokens
    return ids, mask


_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=128, vocab_size=1000)


def _hf_bert():
    from transformers import BertConfig, BertModel
    ids, mask = _tokens()
    return BertModel(BertConfig(**_SMALL)), (), {"input_ids": ids, "attention_mask": mask}, \
        "BertModel, 2 layers, 64 hidden, seq 16 + attention_mask"


def _hf_roberta():
    from transformers import RobertaConfig, RobertaModel
    ids, mask = _tokens()
    return RobertaModel(RobertaConfig(**_SMALL)), (), \
        {"input_ids": ids, "attention_mask": mask}, "RobertaModel, 2 layers, 64 hidden"


def _hf_distilbert():
    from transformers import DistilBertConfig, DistilBertModel
    ids, mask = _tokens()
    cfg = DistilBertConfig(dim=64, n_layers=2, n_heads=2, hidden_dim=128, vocab_size=1000)
    return DistilBertModel(cfg), (), {"input_ids": ids, "attention_mask": mask}, \
        "DistilBertModel, 2 layers, 64 hidden"


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    ids, mask = _tokens()
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, vocab_size=1000,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg), (), {"input_ids": ids, "attention_mask": mask}, \
        "GPT2LMHeadModel, 2 layers, 64 hidden, use_cache=False"


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    ids, mask = _tokens()
    cfg = LlamaConfig(**_SMALL, num_key_value_heads=1, max_position_embeddings=64,
                      use_cache=False)
    return LlamaForCausalLM(cfg), (), {"input_ids": ids, "attention_mask": mask}, \
        "LlamaForCausalLM, 2 layers, 64 hidden, GQA 2:1, use_cache=False"


def _hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    ids, mask = _tokens()
    cfg = Qwen2Config(**_SMALL, num_key_value_heads=1, max_position_embeddings=64,
                      use_cache=False)
    return Qwen2ForCausalLM(cfg), (), {"input_ids": ids, "attention_mask": mask}, \
        "Qwen2ForCausalLM, 2 layers, 64 hidden, use_cache=False"


def _hf_t5():
    from transformers import T5Config, T5ForConditionalGeneration
    ids, mask = _tokens()
    cfg = T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2,
                   num_heads=2, vocab_size=1000, use_cache=False)
    return T5ForConditionalGeneration(cfg), (), \
        {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :8]}, \
        "T5ForConditionalGeneration, 2+2 layers, 64 hidden, decoder_input_ids seq 8"


def _hf_bart():
    from transformers import BartConfig, BartForConditionalGeneration
    ids, mask = _tokens()
    cfg = BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                     vocab_size=1000, max_position_embeddings=64, use_cache=False)
    return BartForConditionalGeneration(cfg), (), \
        {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :8]}, \
        "BartForConditionalGeneration, 2+2 layers, 64 hidden, decoder_input_ids seq 8"


def _hf_vit():
    import torch
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, image_size=64, patch_size=8, num_labels=10)
    return ViTForImageClassification(cfg), (), \
        {"pixel_values": torch.randn(BATCH, 3, 64, 64)}, "ViTForImageClassification, 64x64"


def _hf_wav2vec2():
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    cfg = Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2),
                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=2)
    return Wav2Vec2Model(cfg), (), {"input_values": torch.randn(BATCH, 1600)}, \
        "Wav2Vec2Model, 2 layers, 64 hidden, 1600 samples"


def _hf_whisper():
    import torch
    from transformers import WhisperConfig, WhisperModel
    cfg = WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000,
                        num_mel_bins=16, max_source_positions=32, max_target_positions=32,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1, use_cache=False)
    ids, _ = _tokens()
    return WhisperModel(cfg), (), {"input_features": torch.randn(BATCH, 16, 64),
                                   "decoder_input_ids": ids[:, :8]}, \
        "WhisperModel, 2+2 layers, 64 hidden, 16 mel bins x 64 frames"


HF = {"bert": _hf_bert, "roberta": _hf_roberta, "distilbert": _hf_distilbert,
      "gpt2": _hf_gpt2, "llama": _hf_llama, "qwen2": _hf_qwen2, "t5": _hf_t5, "bart": _hf_bart,
      "vit": _hf_vit, "wav2vec2": _hf_wav2vec2, "whisper": _hf_whisper}


def registry() -> Dict[str, Tuple[str, Callable]]:
    """key -> (family, builder); a builder returns (model, args, kwargs, input note)."""
    reg: Dict[str, Tuple[str, Callable]] = {}
    reg.update(_tv_classification())
    reg.update(_tv_segmentation())
    reg.update(_tv_detection())
    reg.update(_timm())
    reg.update({f"huggingface/{k}": ("huggingface", v) for k, v in HF.items()})
    return reg


# ---------------------------------------------------------------------------------------
# one model (in the child process)
# ---------------------------------------------------------------------------------------
def output_error(ref: Any, got: Any) -> Tuple[Optional[float], str]:
    """max |got - ref| over all floating leaves / max |ref|; (None, why) if not comparable."""
    import torch

    from fxamp.passes.annotate import float_leaves
    a, b = float_leaves(ref), float_leaves(got)
    if len(a) != len(b):
        return None, f"{len(a)} floating outputs in FP32, {len(b)} after the rewrite"
    if not a:
        return None, "no floating outputs"
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return None, f"output shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}"
    if all(x.numel() == 0 for x in a):
        return None, "all floating outputs are empty"
    scale = max(float(x.detach().abs().max()) for x in a if x.numel())
    err = max(float((y.detach().float() - x.detach().float()).abs().max())
              for x, y in zip(a, b) if x.numel())
    if not torch.isfinite(torch.tensor([scale, err])).all():
        return None, f"non-finite: max|ref|={scale}, max err={err}"
    if scale == 0:
        # torchvision's ViTs initialise the classification head to zeros: nothing to compare
        return None, f"the FP32 output is all zeros (max err {err:.1e})"
    return err / scale, ""


def _rewrite(fxamp: Any, model: Any, args: tuple, kwargs: dict) -> Tuple[Any, str]:
    """amp_rewrite with the front-end keywords when this fxamp has them."""
    import torch
    params = inspect.signature(fxamp.amp_rewrite).parameters
    extra: Dict[str, Any] = {}
    note = ""
    if "frontend" in params:
        extra["frontend"] = "auto"
    else:
        note = "fxamp without frontend=: fx only"
    if kwargs:
        if "example_kwargs" in params:
            extra["example_kwargs"] = kwargs
        else:
            # no example_kwargs yet: pass them positionally in the forward's order
            names = list(inspect.signature(model.forward).parameters)
            pos = [None] * len(names)
            for k, v in kwargs.items():
                pos[names.index(k)] = v
            last = max(names.index(k) for k in kwargs)
            args = tuple(args) + tuple(pos[len(args):last + 1])
            note += "; kwargs passed positionally (no example_kwargs=)"
    gm = fxamp.amp_rewrite(model, args,
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu", **extra))
    return gm, note.strip("; ")


def run_one(key: str) -> Dict[str, Any]:
    """Build, rewrite and compare one model; the result record."""
    import resource
    import torch
    import fxamp
    torch.manual_seed(0)
    family, builder = registry()[key]
    rec: Dict[str, Any] = {"key": key, "family": family, "model": key.split("/", 1)[1],
                           "frontend": "", "nodes": None, "rewrite_s": None, "error": None,
                           "error_note": "", "failure": "", "stage": "", "input": "",
                           "note": ""}
    stage = "build"
    try:
        model, args, kwargs, rec["input"] = builder()
        model.eval()
        stage = "fp32 forward"
        with torch.no_grad():
            ref = model(*args, **kwargs)
        stage = "amp_rewrite"
        t0, c0 = time.perf_counter(), time.process_time()
        gm, rec["note"] = _rewrite(fxamp, model, args, kwargs)
        rec["rewrite_s"] = round(time.perf_counter() - t0, 2)
        rewrite_cpu = [time.process_time() - c0]
        rec["frontend"] = fxamp.plan_of(gm).header.get("frontend", "?")
        stage = "plain trace"
        plain = [plain_trace_s(rec["frontend"], model, args, kwargs)]
        for _ in range(REPEAT - 1):  # interleaved with the plain trace; medians
            c0 = time.process_time()
            _rewrite(fxamp, model, args, kwargs)
            rewrite_cpu.append(time.process_time() - c0)
            plain.append(plain_trace_s(rec["frontend"], model, args, kwargs))
        rec["rewrite_cpu_s"] = round(statistics.median(rewrite_cpu), 2)
        if plain[0] is not None:
            rec["plain_cpu_s"] = round(statistics.median(plain), 2)
        rec["nodes"], rec["graphs"] = node_count(gm)
        stage = "rewritten forward"
        gm.eval()
        with torch.no_grad():
            if "example_kwargs" in inspect.signature(fxamp.amp_rewrite).parameters or \
                    not kwargs:
                got = gm(*args, **kwargs)
            else:
                names = list(inspect.signature(model.forward).parameters)
                last = max(names.index(k) for k in kwargs)
                pos = [kwargs.get(n) for n in names[len(args):last + 1]]
                got = gm(*args, *pos)
        stage = "compare"
        rec["error"], rec["error_note"] = output_error(ref, got)
        stage = ""
    except BaseException as e:  # noqa: BLE001 - every failure is a table row
        rec["failure"] = failure_line(e)
        rec["stage"] = stage
        rec["traceback"] = traceback.format_exc()[-4000:]
    rec["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return rec


#: rewrites (and plain traces) per model, interleaved; the medians are reported
REPEAT = int(os.environ.get("FXAMP_COVERAGE_REPEAT", "1"))


def plain_trace_s(frontend: str, model: Any, args: tuple, kwargs: dict) -> Optional[float]:
    """Process CPU seconds of the front end's own trace alone, static shapes
    (``torch.fx.symbolic_trace`` / ``torch.export.export(strict=False)``); None for the
    eager and fx+runtime front ends, or when the plain call fails."""
    import torch
    c0 = time.process_time()
    try:
        if frontend == "fx":
            torch.fx.symbolic_trace(model)
        elif frontend == "export":
            torch.export.export(model, tuple(args), dict(kwargs), strict=False)
        else:
            return None
    except Exception:  # noqa: BLE001 - no plain figure for this model
        return None
    return time.process_time() - c0


def node_count(gm: Any) -> Tuple[Optional[int], int]:
    """(nodes, graphs): a GraphModule's node count; for a model the eager front end took (a
    copy of the model with rewritten children), the nodes of its outermost GraphModules."""
    import torch.fx as fx
    if isinstance(gm, fx.GraphModule):
        return len(gm.graph.nodes), 1
    total, graphs = 0, 0

    def visit(m: Any) -> None:
        nonlocal total, graphs
        for child in m.children():
            if isinstance(child, fx.GraphModule):
                total, graphs = total + len(child.graph.nodes), graphs + 1
            else:
                visit(child)
    visit(gm)
    return (total if graphs else None), graphs


def failure_line(e: BaseException, width: int = 320) -> str:
    """The exception type and its first line; when the message goes on with one line per
    front end tried (``- fx: ...``, ``- export: ...``), those lines too, each shortened."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    per_frontend = [ln[2:] for ln in lines[1:] if re.match(r"- [\w+]+: ", ln)]
    if per_frontend:
        text += " [" + "; ".join(_short(p, 110) for p in per_frontend) + "]"
    return _short(text, width)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


# ---------------------------------------------------------------------------------------
# the driver (parent process)
# ---------------------------------------------------------------------------------------
def run_isolated(key: str, timeout: float, script: Optional[str] = None,
                 base: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Run one model in a child process (``script --one key``, this file by default; the
    child prints its record on a line starting with MARK); a timeout or a crash becomes the
    row's failure, on top of ``base`` (this script's empty record by default)."""
    family = key.split("/", 1)[0]
    if base is None:
        base = {"key": key, "family": family, "model": key.split("/", 1)[1], "frontend": "",
                "nodes": None, "rewrite_s": None, "error": None, "error_note": "",
                "stage": "", "input": "", "note": ""}
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, script or __file__, "--one", key], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {**base, "failure": f"timeout: no result within {timeout:.0f} s",
                    "wall_s": round(time.perf_counter() - t0, 1)}
        wall = round(time.perf_counter() - t0, 1)
        log.seek(0)
        text = log.read()
    for line in text.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK):]), "wall_s": wall}
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    if proc.returncode == -signal.SIGKILL:
        how += " (killed: out of memory?)"
    return {**base, "failure": f"child process died ({how}): {tail[0][:120]}", "wall_s": wall}


def _fmt_err(rec: Dict[str, Any]) -> str:
    if rec.get("error") is not None:
        return f"{rec['error']:.1e}"
    return f"n/a ({rec['error_note']})" if rec.get("error_note") else ""


def _fmt_nodes(rec: Dict[str, Any]) -> str:
    if rec.get("nodes") is None:
        return ""
    graphs = rec.get("graphs", 1)
    return f"{rec['nodes']} in {graphs} graphs" if graphs > 1 else str(rec["nodes"])


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def table(rows: List[Dict[str, Any]]) -> str:
    """The results as a markdown table, below a line naming the CPU's bf16 support."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import cpu_bf16  # imports torch: only here, in the parent process

    head = ["family", "model", "input", "frontend", "fx nodes", "rewrite s", "plain trace CPU s",
            "rewrite CPU s", "rewrite/plain", "rel. output error", "failure"]
    out = [cpu_bf16(), "", "| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        fail = r.get("failure", "")
        if fail and r.get("stage"):
            fail = f"{r['stage']}: {fail}"
        cells = [r["family"], r["model"], r.get("input", ""), r.get("frontend") or "-",
                 _fmt_nodes(r),
                 r["rewrite_s"] if r.get("rewrite_s") is not None else "",
                 r.get("plain_cpu_s", ""), r.get("rewrite_cpu_s", ""), _ratio(r),
                 _fmt_err(r), fail]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out)


def _ratio(rec: Dict[str, Any]) -> str:
    plain, rew = rec.get("plain_cpu_s"), rec.get("rewrite_cpu_s")
    return f"{rew / plain:.1f}" if plain and rew is not None else ""


def _reason_key(rec: Dict[str, Any]) -> str:
    """Failures grouped by exception type and message, with numbers and names dropped."""
    fail = rec["failure"]
    fail = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", fail)
    fail = re.sub(r"\b(takes|trace|export) [A-Z]\w*", r"\1 <model>", fail)
    fail = re.sub(r"\d+", "N", fail)
    return (f"{rec['stage']}: " if rec.get("stage") else "") + fail[:140]


def summary(rows: List[Dict[str, Any]]) -> str:
    ok = [r for r in rows if not r.get("failure")]
    per_fe = collections.Counter(r["frontend"] for r in ok)
    lines = [f"- models run: {len(rows)}; rewritten and run: {len(ok)}; "
             f"failed: {len(rows) - len(ok)}"]
    for fe, n in sorted(per_fe.items(), key=lambda kv: -kv[1]):
        lines.append(f"- frontend `{fe}`: {n}")
    fam = collections.defaultdict(lambda: [0, 0])
    for r in rows:
        fam[r["family"]][0] += 1
        fam[r["family"]][1] += 0 if r.get("failure") else 1
    lines.append("- per family (rewritten / run): " + ", ".join(
        f"{f} {v[1]}/{v[0]}" for f, v in fam.items()))
    errs = sorted(r["error"] for r in ok if r.get("error") is not None
                  and "detection" not in r["family"])
    if errs:
        lines.append(f"- relative output error of the rewritten models (detection models "
                     f"apart, see the columns' note): median {statistics.median(errs):.1e}, "
                     f"max {errs[-1]:.1e}, {sum(e > 5e-2 for e in errs)} above 5e-2 "
                     f"({len(errs)} comparable; the others are listed with the reason)")
    groups = collections.defaultdict(list)
    for r in rows:
        if r.get("failure"):
            groups[_reason_key(r)].append(r["model"])
    if groups:
        lines.append("\nFailures grouped by reason:\n")
        for reason, models in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {len(models)} × `{reason}`: {', '.join(models)}")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        cpu = m.group(1).strip() if m else cpu
    except Exception:  # noqa: BLE001
        pass
    return f"{cpu}, {os.cpu_count()} logical cores, {platform.system()}, " \
           f"Python {platform.python_version()}"


def versions() -> str:
    import importlib.metadata as md
    out = []
    for pkg in ("torch", "torchvision", "timm", "transformers"):
        try:
            out.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def git_commit() -> str:
    """The repository's commit, with "+ uncommitted changes" if src/ differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"
    return (head or "?") + (" + uncommitted changes in src/" if dirty else "")


def write_doc(rows: List[Dict[str, Any]], argv: List[str], elapsed: float,
              excluded: Dict[str, str], date: Optional[str] = None,
              commit: Optional[str] = None) -> None:
    import fxamp
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fe = "frontend=\"auto\"" if "frontend" in inspect.signature(fxamp.amp_rewrite).parameters \
        else "no frontend= keyword yet (fx only)"
    shown, skip = [], False             # the command without --json FILE (a local path)
    for a in argv:
        if skip or a == "--json" or a.startswith("--json="):
            skip = a == "--json"
            continue
        shown.append(a)
    cmd = "python benchmarks/coverage.py " + " ".join(shlex.quote(a) for a in shown)
    text = f"""# fxamp model coverage

Generated by `benchmarks/coverage.py` (rerun it to regenerate this file).

- date: {date} (start of the run)
- machine: {machine()}
- versions: {versions()}, fxamp {fxamp.__version__} at commit {commit or git_commit()} ({fe})
- command: `{cmd}` ({elapsed / 60:.0f} min)

Every model has random weights (torchvision `weights=None`, timm `pretrained=False`, Hugging
Face models from small configs with caches off); nothing is downloaded. Each is put in eval
mode, run in FP32, rewritten with `fxamp.amp_rewrite(model, args, fxamp.RewriteConfig.make(
example_kwargs=kwargs, dtype=torch.bfloat16, target="cpu"))` and run on the same input, each model
in its own process. Inputs: batch {BATCH}; images 64x64 unless the model fixes or needs a
larger size (the input column); token sequences of length {SEQ} with an attention mask whose
second row ends in 4 padding tokens.

Columns: **frontend** is `plan_of(gm).header["frontend"]` (`fx`: `torch.fx.symbolic_trace`;
`export`: `torch.export.export(strict=False)`; `fx+runtime`: fx with the submodules neither
takes rewritten on their own or run under `torch.autocast`; `eager`: the model's own forward
runs eagerly under autocast and its children are rewritten); **fx nodes** is
`len(gm.graph.nodes)` of the rewritten graph, casts included (for `eager`, the sum over its
rewritten children's graphs); **rewrite s** is the wall time
of `amp_rewrite` alone on this shared machine (noisy: other jobs ran on the same cores);
**plain trace CPU s** is the process CPU time of the front end's own trace alone with static
shapes (`torch.fx.symbolic_trace(model)` or `torch.export.export(model, args, kwargs,
strict=False)`; none for `eager`), **rewrite CPU s** that of `amp_rewrite` (medians of
`--repeat` interleaved runs; CPU time is less disturbed than wall time by other load), and
**rewrite/plain** their ratio (the export front end exports with the batch dimension, and the
sequence dimension of integer inputs, symbolic, and a second time, static, in the other mode
for models that read `training`);
**rel. output error** is max |rewritten - FP32| over all floating output leaves divided by
max |FP32| over them (bf16 keeps 8 significant bits, so ~1e-2 is what bf16 compute gives;
random-weight models are not calibrated, so this shows the rewrite runs and stays close, not
deployed accuracy; for detection models the lists of boxes and scores are compared element
by element, and with random weights many scores are nearly equal, so bf16 can swap or
replace boxes after NMS and top-k: there ~1.0 means different boxes, not a wrong rewrite,
and "empty" means no box passed the score threshold); **failure** is the stage and the
exception type with its first line.

## Summary

{summary(rows)}

## Results

{table(rows)}

## Excluded, and why

"""
    text += "\n".join(f"- `{k}`: {v}" for k, v in excluded.items()) or "- none"
    text += "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text + kept_region(ZOO_START, ZOO_END))


#: the region of docs/coverage.md that benchmarks/zoo.py writes; coverage.py keeps it as is
ZOO_START = "<!-- zoo sweep: written by benchmarks/zoo.py -->"
ZOO_END = "<!-- end of zoo sweep -->"


def kept_region(start: str, end: str) -> str:
    """The text of docs/coverage.md from the line ``start`` to the line ``end`` (both kept),
    with a blank line before it; "" when the file has no such region."""
    old = DOC.read_text() if DOC.exists() else ""
    i, j = old.find(start), old.find(end)
    return "" if i < 0 or j < i else "\n" + old[i:j + len(end)] + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="regex: run the models whose key (family/name) matches")
    ap.add_argument("--limit", type=int, help="run the first N models")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per model (300)")
    ap.add_argument("--write", action="store_true", help="regenerate docs/coverage.md")
    ap.add_argument("--json", help="also write the records to this JSON file")
    ap.add_argument("--from-json", metavar="FILE",
                    help="print (and with --write, write) the results saved by an earlier "
                         "run's --json instead of running the models")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rewrites and plain traces per model, interleaved (medians; 1)")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # internal: run one model in this process
    ns = ap.parse_args()
    os.environ["FXAMP_COVERAGE_REPEAT"] = str(ns.repeat)  # read by each model's process
    if ns.one:
        rec = run_one(ns.one)
        print(MARK + json.dumps(rec), flush=True)
        return
    if ns.from_json:
        saved = json.loads(Path(ns.from_json).read_text())
        rows = saved["rows"]
        print(table(rows) + "\n\n" + summary(rows))
        if ns.write:
            write_doc(rows, saved["argv"], saved["elapsed_s"], saved["excluded"],
                      saved["date"], saved["commit"])
            print(f"\nwrote {DOC.relative_to(ROOT)}", file=sys.stderr)
        return
    keys = list(registry())
    excluded = {k: v for k, v in EXCLUDED.items() if k in keys}
    keys = [k for k in keys if k not in EXCLUDED]
    if ns.only:
        keys = [k for k in keys if re.search(ns.only, k)]
        excluded = {k: v for k, v in excluded.items() if re.search(ns.only, k)}
    if ns.limit:
        keys = keys[:ns.limit]
    rows: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit()
    for i, key in enumerate(keys, 1):
        rec = run_isolated(key, ns.timeout)
        rows.append(rec)
        status = rec.get("failure") or f"ok {rec.get('frontend')} err={_fmt_err(rec)}"
        print(f"[{i}/{len(keys)}] {key} ({rec.get('wall_s')} s): {status}", file=sys.stderr,
              flush=True)
        if ns.json:
            Path(ns.json).write_text(json.dumps(
                {"argv": sys.argv[1:], "date": date, "commit": commit,
                 "elapsed_s": time.perf_counter() - t0,
                 "excluded": excluded, "rows": rows}, indent=1))
    elapsed = time.perf_counter() - t0
    print(table(rows))
    print()
    print(summary(rows))
    if excluded:
        print("\nExcluded:\n" + "\n".join(f"- {k}: {v}" for k, v in excluded.items()))
    if ns.write:
        write_doc(rows, sys.argv[1:], elapsed, excluded, date, commit)
        print(f"\nwrote {DOC.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
