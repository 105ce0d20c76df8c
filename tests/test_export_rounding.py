"""Each weight of the FP16 ONNX file is rounded once: a BatchNorm folded into its Conv equals
the FP32 fold of the model's own weights and running statistics, cast to FP16 once, element
for element; a Transpose of a weight is folded too (no Transpose reads an initializer)."""
from typing import List, Tuple

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.export import export_onnx

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.slow  # exports timm / torchvision models


def once_rounded_conv_weights(model: nn.Module, x: torch.Tensor
                              ) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
    """(conv name, expected FP16 weight, expected FP16 bias) per Conv2d in execution order:
    the BatchNorm that reads a conv's output folded in FP32, then cast to FP16 once."""
    order: List[nn.Conv2d] = []
    names = {m: n for n, m in model.named_modules()}
    produced = {}
    bn_of = {}

    def conv_hook(module, args, out):
        order.append(module)
        produced[id(out)] = (module, out)

    def bn_hook(module, args, out):
        hit = produced.get(id(args[0]))
        if hit is not None and hit[1] is args[0]:
            bn_of[hit[0]] = module

    hooks = [m.register_forward_hook(conv_hook if isinstance(m, nn.Conv2d) else bn_hook)
             for m in model.modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    expected = []
    with torch.no_grad():
        for conv in order:
            w = conv.weight.float()
            b = conv.bias.float() if conv.bias is not None else torch.zeros(w.shape[0])
            bn = bn_of.get(conv)
            if bn is not None:  # the fold, in FP32 (numpy: IEEE-rounded sqrt; torch's
                # vectorised CPU sqrt can be 1 ulp off)
                var = bn.running_var.numpy() + np.float32(bn.eps)
                scale = torch.from_numpy(bn.weight.numpy() / np.sqrt(var))
                w = w * scale.reshape(-1, 1, 1, 1)
                b = (b - bn.running_mean) * scale + bn.bias
            expected.append((names[conv], w.half(), b.half()))
    return expected


def onnx_conv_weights(path) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
    """(node name, weight, bias) of every Conv of the file, in graph order."""
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy())
             for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type == "Conv":
            bias = inits.get(node.input[2]) if len(node.input) > 2 else None
            out.append((node.name, inits.get(node.input[1]), bias))
    return out


def mismatched_convs(model: nn.Module, x: torch.Tensor, path) -> List[str]:
    """The convs whose FP16 weight or bias differs from the once-rounded fold anywhere."""
    expected, got = once_rounded_conv_weights(model, x), onnx_conv_weights(path)
    assert len(expected) == len(got)
    bad = []
    for (name, w, b), (node, gw, gb) in zip(expected, got):
        assert gw is not None and gw.dtype == torch.float16, (node, gw)
        if not (torch.equal(gw, w) and (gb is None or torch.equal(gb, b))):
            bad.append(f"{name} ({node}): {(gw != w).float().mean():.0%} of weights differ")
    return bad


def _export(model, x, target, path):
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(target=target))
    return export_onnx(gm, (x,), str(path), reference=model)


@pytest.mark.parametrize("target", ["tensorrt", "cuda"])
def test_mobilenetv3_conv_weights_are_the_once_rounded_fp32_fold(tmp_path, target):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_100", pretrained=False).eval()
    for m in model.modules():  # running statistics that are not the init's 0 and 1
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.2, 3.0)
    x = torch.randn(1, 3, 64, 64)
    path = _export(model, x, target, tmp_path / "m.onnx")
    assert mismatched_convs(model, x, path) == []
    names = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "BatchNormalization" not in names


@pytest.mark.parametrize("target", ["tensorrt", "cuda"])
def test_resnet18_conv_weights_are_the_once_rounded_fp32_fold(tmp_path, target):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.2, 3.0)
            m.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(1, 3, 64, 64)
    path = _export(model, x, target, tmp_path / "r.onnx")
    assert mismatched_convs(model, x, path) == []


def test_resnet18_conv_weights_from_the_torchscript_exporter_are_the_once_rounded_fold(
        tmp_path):
    """The TorchScript exporter's own constant folding would write the weights FP16 before
    fxamp folds BatchNorm into them (rounded twice: about a quarter of them an ulp off)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.2, 3.0)
            m.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(1, 3, 64, 64)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(target="cuda"))
    path = export_onnx(gm, (x,), str(tmp_path / "r.onnx"), reference=model,
                       exporter="torchscript")
    proto = onnx.load(str(path))
    assert {p.key: p.value for p in proto.metadata_props}["fxamp.exporter"] == "torchscript"
    assert "BatchNormalization" not in [n.op_type for n in proto.graph.node]
    assert mismatched_convs(model, x, path) == []


def test_swin_has_no_transpose_of_an_initializer(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=64,
                              embed_dim=24, depths=(1, 1), num_heads=(1, 2), window_size=4,
                              num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    path = _export(model, x, "tensorrt", tmp_path / "s.onnx")
    proto = onnx.load(str(path))
    inits = {i.name for i in proto.graph.initializer}
    on_weights = [n.name for n in proto.graph.node
                  if n.op_type == "Transpose" and n.input[0] in inits]
    assert on_weights == []
    # the linear weights are FP16 initializers, the transposed FP32 weight rounded once
    names = dict(model.named_parameters())
    from onnx import numpy_helper
    values = [numpy_helper.to_array(i) for i in proto.graph.initializer]
    w = names["layers.0.blocks.0.mlp.fc1.weight"].detach()
    assert any(v.dtype.name == "float16" and v.shape == tuple(w.T.shape)
               and (torch.from_numpy(v.copy()) == w.T.half()).all() for v in values)
