"""On a real CUDA GPU (``pytest -m cuda``; skipped elsewhere): autocast agreement on real
CUDA tensors, real torchvision models moved to ``cuda`` and rewritten, and short FP16 / BF16
training runs with GradScaler. Meant to take well under 3 minutes on one GPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as tvm

import fxamp
from autocast_list_cases import Case, all_cases
from autocast_truth import autocast_rewrite, record_autocast_dtypes
from test_autocast_test_lists import check_case

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: PyTorch's CUDA autocast tests run every list in fp16 and the lower-precision lists in
#: bf16 too (test_autocast_torch_bf16, test_autocast_nn_bf16)
_BF16_LISTS = {"torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16"}
CUDA_CASES = all_cases("cuda", torch.float16) + [
    c for c in all_cases("cuda", torch.bfloat16) if c.entry.list_name in _BF16_LISTS
] if torch.cuda.is_available() else []  # (building the cases costs collection time)
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


@pytest.mark.parametrize("case", CUDA_CASES, ids=[c.id for c in CUDA_CASES])
def test_autocast_lists_on_real_cuda(case: Case) -> None:
    """Plan = what CUDA autocast does on real CUDA tensors; outputs as under autocast."""
    check_case(case, device="cuda")


def _model(name: str) -> tuple:
    torch.manual_seed(0)
    if name == "resnet18":
        return tvm.resnet18(weights=None, num_classes=10).eval(), torch.randn(2, 3, 64, 64)
    # ViT-B/16 at 64x64: 16 tokens + class token through all 12 blocks
    return (tvm.vit_b_16(weights=None, num_classes=10, image_size=64).eval(),
            torch.randn(2, 3, 64, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["resnet18", "vit_b_16"])
def test_real_model_on_cuda(name: str, dtype: torch.dtype) -> None:
    """Moved to cuda first, as a GPU user does: the plan is what CUDA autocast does node by
    node, nothing leaves the GPU, and the output is close to the model's under autocast."""
    model, x = _model(name)
    model, x = model.cuda(), x.cuda()
    gm = autocast_rewrite(model, (x,), dtype=dtype, target="cuda")
    truth = record_autocast_dtypes(torch.fx.symbolic_trace(model), (x,), "cuda", dtype)
    plan = fxamp.plan_of(gm)
    wrong = {n: (plan.nodes[n].dtype if n in plan.nodes else None, d)
             for n, d in truth.items() if n not in plan.nodes or plan.nodes[n].dtype != d}
    assert not wrong
    assert {t.device.type for t in list(gm.parameters()) + list(gm.buffers())} == {"cuda"}
    with torch.no_grad():
        out = gm(x)
        with torch.autocast("cuda", dtype=dtype):
            want = model(x)
    assert out.device.type == "cuda" and out.dtype == want.dtype
    torch.testing.assert_close(out.float(), want.float(), rtol=0.05, atol=0.05)
    # the full default policy (numerics passes on) also rewrites and runs on the GPU
    full = fxamp.amp_rewrite(copy.deepcopy(model), (x,),
                             fxamp.RewriteConfig.make(dtype=dtype, target="cuda"))
    with torch.no_grad():
        assert torch.isfinite(full(x).float()).all()


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        h = F.relu(self.bn(self.conv1(x)))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc(self.norm(h.mean((2, 3))))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_training_on_cuda(dtype: torch.dtype) -> None:
    """20 steps with GradScaler on cuda: the loss halves, parameters stay finite and FP32,
    gradients are FP32."""
    torch.manual_seed(0)
    model = SmallCNN().cuda().train()
    x = torch.randn(32, 3, 16, 16, device="cuda")
    y = (x[:, 0].mean((1, 2)) > 0).long()  # learnable: the sign of channel 0's mean
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=dtype, target="cuda"))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    losses = []
    for _ in range(20):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(gm(x).float(), y)
        scaler.scale(loss).backward()
        grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        assert grads == {torch.float32}
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
