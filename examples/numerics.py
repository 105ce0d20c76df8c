"""What autocast leaves to you, fixed by fxamp's numerics passes.

A hand-written RMSNorm with eps=1e-12 (0 in fp16) fed rows of zeros, and a hand-written MSE
of residuals near 1e-4 (their squares underflow fp16): plain CPU autocast in fp16 gives NaN
and 0; the rewritten model gives the FP32 answers. Run: python examples/numerics.py
"""
import torch
import torch.nn as nn

import fxamp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.eps = 1e-12

    def forward(self, x):
        h = self.a(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)   # hand-written RMSNorm
        return self.b(h)


class Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.a.weight.mul_(0.01)
            self.a.bias.zero_()
            self.b.weight.copy_(self.a.weight)
            self.b.bias.fill_(1e-4)                    # residuals of 1e-4 between the branches

    def forward(self, x):
        return ((self.a(x) - self.b(x)) ** 2).mean()   # hand-written MSE


torch.manual_seed(0)
net, loss = Net(), Loss()
nn.init.zeros_(net.a.bias)
zeros, x = torch.zeros(4, 8), torch.randn(16, 8)
with torch.autocast("cpu", dtype=torch.float16):
    plain = (net(zeros).abs().max().item(), loss(x).item())
gm_net = fxamp.amp_rewrite(net, (zeros,),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))
gm_loss = fxamp.amp_rewrite(loss, (x,), fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))
print(f"RMSNorm of zero rows, max |out|: fp32 {net(zeros).abs().max().item():.4f}  "
      f"autocast {plain[0]}  fxamp {gm_net(zeros).abs().max().item():.4f}")
print(f"MSE of 1e-4 residuals:           fp32 {loss(x).item():.3e}  autocast {plain[1]:.3e}  "
      f"fxamp {gm_loss(x).item():.3e}")
print(fxamp.plan_of(gm_net).to_text())
