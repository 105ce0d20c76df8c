"""custom_ops pass: opaque custom calls get FP32 inputs unless the policy says otherwise."""
import torch
import torch.nn as nn

import fxamp


class NeedsFp32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if x.dtype != torch.float32:
            raise TypeError(f"NeedsFp32 got {x.dtype}")
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(NeedsFp32.apply(self.a(x)))


def test_function_that_refuses_low_precision_works_after_the_rewrite():
    model = Model()
    x = torch.randn(4, 8)
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)
        plain = "ran"
    except TypeError as err:
        plain = str(err)
    assert "float16" in plain  # plain autocast hands it fp16
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu"))
    out = gm(x)
    with torch.autocast("cpu", dtype=torch.float16):
        ref = model.b(NeedsFp32.apply(model.a(x).float()))
    assert torch.equal(out, ref.float())
    out.sum().backward()
    assert model.a.weight.grad.dtype == torch.float32
    p = fxamp.plan_of(gm).nodes["needs_fp32_apply"]
    assert (p.rule, p.dtype, p.inputs) == ("custom_ops", torch.float32, torch.float32)


def test_policy_can_name_a_custom_op_low_precision():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, g):
            return g * 3

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return Scale.apply(self.fc(x))

    x = torch.randn(2, 8)
    gm = fxamp.amp_rewrite(M(), (x,),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cpu",
                                                    policy="fp16:scale_apply"))
    p = fxamp.plan_of(gm).nodes["scale_apply"]
    assert (p.rule, p.dtype) == ("user", torch.float16)


def test_torch_nn_composites_stay_with_autocast_at_run_time():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    plan = fxamp.plan_of(fxamp.amp_rewrite(M(), (torch.randn(2, 3, 8),)))
    assert plan.nodes["mha"].rule == "runtime"
