"""Your own decision rule: keep every op that reads a tensor named ``*_scale`` in FP32.

A learned scalar gain (a 0-dim Parameter or buffer) multiplies a bf16 activation in bf16
under autocast (a 0-dim tensor does not promote the other operand), and bf16 keeps 8
significant bits: a gain of 1.0039 counts as 1.0. The rule keeps those multiplies in FP32,
and the plan names it in its rule column. Run: python examples/user_rules.py
"""
import torch
import torch.nn as nn

import fxamp


class KeepScales(fxamp.DecisionRule):
    """Every op reading a parameter or buffer named ``*_scale`` computes in FP32."""

    name = "user:keep_scales"  # the plan's rule column

    def applies(self, node):
        # self.reads(node): the parameters and buffers the op reads ("block.gate_scale")
        return any(path.rsplit(".", 1)[-1].endswith("_scale") for path in self.reads(node))

    def decide(self, node):
        return {node: self.verdict(torch.float32, "reads a *_scale tensor: kept in fp32")}


class ScaledMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 8)
        self.gate_scale = nn.Parameter(torch.tensor(1.0039))  # learned scalar gains
        self.register_buffer("out_scale", torch.tensor(0.9961))

    def forward(self, x):
        h = torch.relu(self.up(x)) * self.gate_scale
        return self.down(h) * self.out_scale


def build():
    """The model and its example inputs (``fxamp plan examples/user_rules.py:build``)."""
    torch.manual_seed(0)
    return ScaledMLP(), (torch.randn(4, 16),)


if __name__ == "__main__":
    model, inputs = build()
    gm = fxamp.amp_rewrite(model, inputs,
                           fxamp.RewriteConfig.make(policy="compute=bf16,target=cpu",
                                                    rules=[KeepScales()]))
    print(fxamp.plan_of(gm).to_text())
