"""A model with the mistakes the audit finds: run `fxamp audit examples.audit_demo:build`."""
import torch, torch.nn as nn, torch.nn.functional as F

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(60, 180)
        self.out = nn.Linear(60, 60)
        self.norm = nn.LayerNorm(60, eps=1e-12)

    def forward(self, x, y):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        w = torch.exp(q @ k.transpose(-1, -2) / 8)      # no max-shift
        a = (w / w.sum(-1, keepdim=True).clamp_min(1e-6)) @ v
        h = self.out(a).half().float()
        return F.binary_cross_entropy(torch.sigmoid(h), y)

def build():
    return Attn(), (torch.randn(2, 5, 60), torch.rand(2, 5, 60))
