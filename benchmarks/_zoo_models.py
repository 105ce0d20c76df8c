"""The models of the zoo sweep (benchmarks/zoo.py): one timm model per architecture module,
the torchvision classification, segmentation, video and detection models, and Hugging Face
architectures from tiny configs (random weights; nothing is downloaded).

The torchvision builders and the hand-written Hugging Face builders are benchmarks/coverage.py's;
this module adds the timm picks, the video models, detection targets for a training step and
generic tiny Hugging Face configs. A builder returns ``(model, args, kwargs, input note)``.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # random weights only: never the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import coverage as cov  # noqa: E402  (benchmarks/ is on sys.path: scripts run from there)

BATCH = cov.BATCH
SEQ = cov.SEQ

#: one timm model per module of ``timm.list_modules()``: the ``test_*`` model where the module
#: has one, else the one with the fewest parameters (counted on the meta device with
#: ``timm.create_model(name)``; ``python benchmarks/zoo.py --pick-timm`` prints the picks again)
TIMM_PICKS: Dict[str, str] = {
    'beit': 'beit_base_patch16_224',
    'byoanet': 'halonet_h1',
    'byobnet': 'test_byobnet',
    'cait': 'cait_xxs24_224',
    'coat': 'coat_tiny',
    'convit': 'convit_tiny',
    'convmixer': 'convmixer_768_32',
    'convnext': 'test_convnext',
    'cpubone': 'cpubone_nano',
    'crossvit': 'crossvit_tiny_240',
    'csatv2': 'csatv2',
    'cspnet': 'cs3darknet_focus_s',
    'cspnext': 'cspnext_tiny',
    'davit': 'davit_tiny',
    'deepseek_vit': 'deepseek_vit_412m',
    'deit': 'deit_tiny_patch16_224',
    'densenet': 'densenet121',
    'dla': 'dla46x_c',
    'dpn': 'dpn48b',
    'edgenext': 'edgenext_xx_small',
    'efficientformer': 'efficientformer_l1',
    'efficientformer_v2': 'efficientformerv2_s0',
    'efficientnet': 'test_efficientnet',
    'efficientvim': 'efficientvim_m1',
    'efficientvit_mit': 'efficientvit_b0',
    'efficientvit_msra': 'efficientvit_m0',
    'eva': 'vit_tiny_patch16_dinov3_qkvb',
    'fasternet': 'fasternet_t0',
    'fastvit': 'fastvit_t8',
    'focalnet': 'focalnet_tiny_srf',
    'gcvit': 'gcvit_xxtiny',
    'gemma4_vit': 'gemma4_vit_167m',
    'ghostnet': 'ghostnet_050',
    'hardcorenas': 'hardcorenas_b',
    'hgnet': 'hgnetv2_b0',
    'hiera': 'hiera_tiny_224',
    'hieradet_sam2': 'sam2_hiera_tiny',
    'hrnet': 'hrnet_w18_small',
    'iformer': 'iformer_t',
    'inception_next': 'inception_next_atto',
    'inception_resnet_v2': 'inception_resnet_v2',
    'inception_v3': 'inception_v3',
    'inception_v4': 'inception_v4',
    'lcnetv2': 'lcnetv2_small',
    'levit': 'levit_128s',
    'lowformer': 'lowformer_b0',
    'mambaout': 'test_mambaout',
    'maxxvit': 'test_coatnet',
    'metaformer': 'poolformerv2_s12',
    'mlp_mixer': 'gmlp_ti16_224',
    'mobilenetv3': 'mobilenetv3_small_050',
    'mobilenetv5': 'mobilenetv5_base',
    'mobilevit': 'mobilevit_xxs',
    'mvitv2': 'mvitv2_tiny',
    'naflexvit': 'naflexvit_base_patch16_parfac_gap',
    'nasnet': 'nasnetalarge',
    'nest': 'nest_tiny',
    'nextvit': 'nextvit_small',
    'nfnet': 'test_nfnet',
    'pit': 'pit_ti_224',
    'pnasnet': 'pnasnet5large',
    'pvt_v2': 'pvt_v2_b0',
    'qwen3_vit': 'qwen3_vit_88m',
    'rdnet': 'rdnet_tiny',
    'regnet': 'regnetx_002',
    'repghost': 'repghostnet_050',
    'repvit': 'repvit_m1',
    'res2net': 'res2next50',
    'resnest': 'resnest14d',
    'resnet': 'test_resnet',
    'resnetv2': 'resnetv2_18',
    'rexnet': 'rexnet_100',
    'selecsls': 'selecsls42',
    'senet': 'legacy_seresnet18',
    'sequencer': 'sequencer2d_s',
    'shvit': 'shvit_s1',
    'sknet': 'skresnet18',
    'starnet': 'starnet_s050',
    'swiftformer': 'swiftformer_xs',
    'swin_transformer': 'swin_tiny_patch4_window7_224',
    'swin_transformer_v2': 'swinv2_tiny_window8_256',
    'swin_transformer_v2_cr': 'swinv2_cr_tiny_224',
    'tiny_vit': 'tiny_vit_5m_224',
    'tnt': 'tnt_s_legacy_patch16_224',
    'tresnet': 'tresnet_m',
    'twins': 'twins_svt_small',
    'vgg': 'vgg11',
    'visformer': 'visformer_tiny',
    'vision_transformer': 'test_vit',
    'vision_transformer_hybrid': 'vit_tiny_r_s16_p8_224',
    'vision_transformer_relpos': 'test_vit_relpos',
    'vision_transformer_sam': 'samvit_base_patch16_224',
    'vitamin': 'vitamin_small_224',
    'volo': 'volo_d1_224',
    'vovnet': 'ese_vovnet19b_slim_dw',
    'xception': 'legacy_xception',
    'xception_aligned': 'xception41p',
    'xcit': 'xcit_nano_12_p8_224',
}

#: models left out of the run up front, with the reason (listed in docs/coverage.md)
EXCLUDED = {
    **cov.EXCLUDED,
    "torchvision/vit_l_16": "304M parameters at a fixed 224x224 input (61 GFLOPs per image): "
                            "a training step on both sides does not fit the time limit on 2 "
                            "shared cores; not measured",
    "torchvision/vit_l_32": "306M parameters at a fixed 224x224 input: left out for the same "
                            "reason; not measured",
    "torchvision/regnet_y_32gf": "145M parameters: left out for the same reason; not measured",
    "torchvision/mvit_v1_b": "fixed 16x224x224 clips (71 GFLOPs per clip): left out for the "
                             "same reason; not measured",
    "torchvision/mvit_v2_s": "fixed 16x224x224 clips (65 GFLOPs per clip): left out for the "
                             "same reason; not measured",
    "torchvision/swin3d_b": "88M parameters on video clips: left out for the same reason; not "
                            "measured",
}


def pick_timm() -> Dict[str, str]:
    """module -> its test_* model or its smallest model by parameter count (meta device)."""
    import timm
    import torch
    picks = {}
    for module in timm.list_modules():
        names = timm.list_models(module=module)
        tests = [n for n in names if n.startswith("test_")]
        best, size = None, None
        for name in tests or names:
            try:
                with torch.device("meta"):
                    model = timm.create_model(name, pretrained=False)
            except Exception:  # noqa: BLE001 - not constructible here: not a candidate
                continue
            n = sum(p.numel() for p in model.parameters())
            if size is None or n < size:
                best, size = name, n
        if best:
            picks[module] = best
    return picks


def _timm(name: str):
    """A timm model at 64x64 where it takes any size, else at its configured input size."""
    import timm
    import torch
    model = timm.create_model(name, pretrained=False)
    cfg = model.pretrained_cfg
    size = tuple(cfg.get("input_size", (3, 224, 224)))
    note = "configured size"
    if not cfg.get("fixed_input_size", False) and size[1:] != (64, 64):
        try:                           # a probe in eval mode: does the model take 64x64?
            model.eval()
            with torch.no_grad():
                model(torch.randn(BATCH, 3, 64, 64))
            size, note = (3, 64, 64), "takes 64x64"
        except Exception:  # noqa: BLE001 - keep the configured size
            pass
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)   # the probe does not touch its weights
    return model, (torch.randn(BATCH, *size),), {}, f"{size[1]}x{size[2]} ({note})"


def _tv_video(name: str):
    import torch
    import torchvision
    model = torchvision.models.get_model(name, weights=None)
    # S3D ends in a (2, 7, 7) average pool: 16 frames of 224x224 at least
    shape = (BATCH, 3, 8, 64, 64) if name != "s3d" else (BATCH, 3, 16, 224, 224)
    return model, (torch.randn(*shape),), {}, "clips " + "x".join(map(str, shape[2:]))


def detection_targets(name: str, n: int = BATCH) -> List[Dict[str, Any]]:
    """Targets for a detection model's training step: one box per 64x64 image (masks for Mask
    R-CNN, keypoints for Keypoint R-CNN)."""
    import torch
    out = []
    for i in range(n):
        t: Dict[str, Any] = {"boxes": torch.tensor([[8.0 + i, 10.0, 40.0, 50.0 - i]]),
                             "labels": torch.tensor([1])}   # Keypoint R-CNN has 2 classes
        if "maskrcnn" in name:
            mask = torch.zeros(1, 64, 64, dtype=torch.uint8)
            mask[:, 10:50, 8:40] = 1
            t["masks"] = mask
        if "keypoint" in name:
            kp = torch.zeros(1, 17, 3)
            kp[0, :, 0] = torch.linspace(10, 38, 17)
            kp[0, :, 1] = torch.linspace(12, 48, 17)
            kp[0, :, 2] = 1
            t["keypoints"] = kp
        out.append(t)
    return out


# --- Hugging Face: generic tiny configs --------------------------------------------------
_TXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            vocab_size=1000, max_position_embeddings=64)
_DEC = dict(_TXT, num_key_value_heads=1, use_cache=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
_S2S = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
            vocab_size=1000, max_position_embeddings=64, use_cache=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
_IMG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            image_size=64, patch_size=8, num_labels=10)
_AUDIO = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2),
              conv_kernel=(10, 3), num_conv_pos_embeddings=16,
              num_conv_pos_embedding_groups=2)

#: model_type -> (auto class, input kind, config keywords)
HF_GENERIC: Dict[str, Tuple[str, str, Dict[str, Any]]] = {
    # encoders
    "albert": ("AutoModel", "text", dict(_TXT, embedding_size=32)),
    "electra": ("AutoModel", "text", dict(_TXT, embedding_size=64)),
    "deberta": ("AutoModel", "text", _TXT),
    "deberta-v2": ("AutoModel", "text", _TXT),
    "xlm-roberta": ("AutoModel", "text", dict(_TXT, pad_token_id=1)),
    "camembert": ("AutoModel", "text", dict(_TXT, pad_token_id=1)),
    "mpnet": ("AutoModel", "text", dict(_TXT, pad_token_id=1)),
    "convbert": ("AutoModel", "text", dict(_TXT, embedding_size=64)),
    "roformer": ("AutoModel", "text", dict(_TXT, embedding_size=64)),
    "squeezebert": ("AutoModel", "text", dict(_TXT, embedding_size=64)),
    "ernie": ("AutoModel", "text", _TXT),
    "megatron-bert": ("AutoModel", "text", _TXT),
    "data2vec-text": ("AutoModel", "text", dict(_TXT, pad_token_id=1)),
    "layoutlm": ("AutoModel", "text", _TXT),
    "esm": ("AutoModel", "text", dict(_TXT, pad_token_id=1, mask_token_id=4)),
    "fnet": ("AutoModel", "text", _TXT),
    # decoders
    "gpt_neo": ("AutoModelForCausalLM", "text",
                dict(_DEC, attention_types=[[["global", "local"], 1]], window_size=8)),
    "gptj": ("AutoModelForCausalLM", "text", dict(_DEC, rotary_dim=16)),
    "opt": ("AutoModelForCausalLM", "text", dict(_DEC, ffn_dim=128, word_embed_proj_dim=64)),
    "mixtral": ("AutoModelForCausalLM", "text", dict(_DEC, num_local_experts=2)),
    "qwen3": ("AutoModelForCausalLM", "text", dict(_DEC, head_dim=32)),
    "qwen2_moe": ("AutoModelForCausalLM", "text",
                  dict(_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64)),
    "gemma": ("AutoModelForCausalLM", "text", dict(_DEC, head_dim=32)),
    "gemma2": ("AutoModelForCausalLM", "text", dict(_DEC, head_dim=32)),
    "codegen": ("AutoModelForCausalLM", "text", dict(_DEC, rotary_dim=16, n_ctx=64)),
    "xglm": ("AutoModelForCausalLM", "text", dict(_DEC, d_model=64, ffn_dim=128,
                                                   num_layers=2)),
    # vision
    "deit": ("DeiTForImageClassification", "image", _IMG),
    "beit": ("AutoModelForImageClassification", "image", _IMG),
    "dinov2": ("AutoModelForImageClassification", "image", _IMG),
    "data2vec-vision": ("AutoModelForImageClassification", "image", _IMG),
    "swin": ("AutoModelForImageClassification", "image",
             dict(image_size=64, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4],
                  window_size=4, num_labels=10)),
    "convnext": ("AutoModelForImageClassification", "image",
                 dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10)),
    "resnet": ("AutoModelForImageClassification", "image",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
    "segformer": ("AutoModelForImageClassification", "image",
                  dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2,
                       sr_ratios=[2, 1], num_attention_heads=[1, 2], patch_sizes=[7, 3],
                       strides=[4, 2], mlp_ratios=[2, 2], num_labels=10)),
    "mobilevit": ("AutoModelForImageClassification", "image",
                  dict(image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[
                      8, 8, 16, 16, 24, 32, 64], num_labels=10)),
    # audio
    "hubert": ("AutoModel", "audio", _AUDIO),
    "wavlm": ("AutoModel", "audio", _AUDIO),
    "data2vec-audio": ("AutoModel", "audio", _AUDIO),
}
#: decoders and encoder-decoders with the default tiny config
HF_GENERIC.update({t: ("AutoModelForCausalLM", "text", _DEC) for t in (
    "gpt_neox", "gpt_bigcode", "bloom", "falcon", "mistral", "phi", "phi3", "stablelm",
    "starcoder2", "olmo", "cohere", "granite", "biogpt")})
HF_GENERIC.update({t: ("AutoModelForSeq2SeqLM", "seq2seq", _S2S) for t in (
    "mbart", "pegasus", "marian", "blenderbot", "m2m_100")})


def _hf_generic(model_type: str):
    import torch
    import transformers
    auto, kind, kw = HF_GENERIC[model_type]
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cls = getattr(transformers, auto)
    model = cls.from_config(cfg) if auto.startswith("Auto") else cls(cfg)
    if kind == "image":
        return model, (), {"pixel_values": torch.randn(BATCH, 3, 64, 64)}, \
            f"{type(model).__name__}, 64x64"
    if kind == "audio":
        return model, (), {"input_values": torch.randn(BATCH, 1600)}, \
            f"{type(model).__name__}, 1600 samples"
    ids, mask = cov._tokens()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    note = f"{type(model).__name__}, seq {SEQ} + attention_mask"
    if kind == "seq2seq":
        kwargs["decoder_input_ids"] = ids[:, :8]
        note += ", decoder_input_ids seq 8"
    return model, (), kwargs, note


def registry() -> Dict[str, Tuple[str, Callable]]:
    """key -> (family, builder); the family is timm's module name for timm models."""
    import torchvision
    reg: Dict[str, Tuple[str, Callable]] = {}
    for k, b in cov.HF.items():
        reg[f"huggingface/{k}"] = ("huggingface", b)
    for k in HF_GENERIC:
        if f"huggingface/{k}" not in reg:
            reg[f"huggingface/{k}"] = ("huggingface", lambda k=k: _hf_generic(k))
    for module, name in TIMM_PICKS.items():
        reg[f"timm/{name}"] = (f"timm {module}", lambda name=name: _timm(name))
    for family, models in (("torchvision segmentation", cov._tv_segmentation()),
                           ("torchvision detection", cov._tv_detection())):
        reg.update({k: (family, b) for k, (_, b) in models.items()})
    for name in torchvision.models.list_models(module=torchvision.models.video):
        reg[f"torchvision/{name}"] = ("torchvision video", lambda name=name: _tv_video(name))
    reg.update({k: ("torchvision classification", b)
                for k, (_, b) in cov._tv_classification().items()})
    return reg


def is_detection(key: str) -> bool:
    return re.search(r"rcnn|retinanet|fcos|ssd", key) is not None
