"""Front ends: a model torch.fx cannot trace whole, rewritten with fxamp's fallback chain.

``shape`` branches on a shape (torch.fx cannot; torch.export can), ``gate`` branches on a
tensor value (neither can). frontend="auto" (the default) traces the model with torch.fx
around both, rewrites ``shape`` on its own with torch.export, and runs ``gate``'s forward
eagerly under torch.autocast with its Linear rewritten. Run: python examples/frontends.py
"""
import torch
import torch.nn as nn

import fxamp


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[-1] == 8:  # torch.fx: "symbolically traced variables cannot be used..."
            return torch.relu(self.lin(x))
        return x


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # a branch on a value: no tracer can take it
            return self.lin(x)
        return -self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.shape, self.gate, self.head = ShapeBranch(), Gate(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.gate(self.shape(x)))


torch.manual_seed(0)
model, x = Net(), torch.randn(4, 8)
gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
print(fxamp.plan_of(gm).to_text())
print("max |rewritten - fp32|:", f"{(gm(x) - model(x)).abs().max().item():.4f}")
