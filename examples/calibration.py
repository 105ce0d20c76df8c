"""Calibration: activations past fp16's range found on real batches and kept in FP32.

Run: python examples/calibration.py
"""
import torch
import torch.nn as nn

import fxamp


class Net(nn.Module):
    """A layer whose outputs reach ~1e5 on normal inputs (as in T5's feed-forward)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.b.weight.mul_(10000)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x))) * 3
        return self.c(h / 1000)


torch.manual_seed(0)
model = Net()
batches = [(torch.randn(8, 16) * 4,) for _ in range(4)]
x = batches[0][0]
plain = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))
gm = fxamp.amp_rewrite(model, (x,),
                       fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu",
                                                calibration_data=batches))
ref = model(x)
for name, out in (("without calibration", plain(x)), ("with calibration", gm(x))):
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    print(f"{name}: finite={torch.isfinite(out).all().item()} max rel err={err:.2g}")
print(fxamp.plan_of(gm).to_text())
