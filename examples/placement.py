"""Cast placement: an FP32 input upsampled x4 into a conv. Casting the small input to bf16
before the upsample moves 16x fewer bytes than casting the upsampled tensor after it.

Run: fxamp plan examples/placement.py:build --dtype bf16 --target cpu
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class UpsampleConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=4, mode="nearest"))


def build():
    torch.manual_seed(0)
    return UpsampleConv(), (torch.randn(2, 4, 8, 8),)
