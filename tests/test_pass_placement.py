"""Placement pass: free follow ops move across the low/FP32 boundary only where fewer bytes are
cast per step; fixed nodes never change; outputs agree with the placement=off rewrite.

Real torch throughout: casts are counted with ``fxamp.perf.count_casts`` over forward and
backward, expected bytes are computed here from the shapes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import fxamp
from fxamp.errors import PolicyError
from fxamp.perf import count_casts
from fxamp.policy import Policy

DT = torch.bfloat16
FOLLOW = "on no autocast list: follows its inputs"
BF16, FP32 = 2, 4  # bytes per element


def rewrite(model, inputs, policy=None):
    return fxamp.amp_rewrite(model, inputs,
                             fxamp.RewriteConfig.make(dtype=DT, target="cpu", policy=policy))


def plans(model, inputs, policy=""):
    off = fxamp.plan_of(rewrite(model, inputs, ",".join(filter(None, [policy, "placement=off"]))))
    on = fxamp.plan_of(rewrite(model, inputs, policy or None))
    return off, on


def step_casts(fn):
    return count_casts(fn, lambda out: out.float().sum().backward())


def changed(off, on):
    return {name for name, p in on.nodes.items() if off.nodes[name] != p}


# -- the policy option ----------------------------------------------------------------
def test_policy_string_form():
    assert Policy().placement is True
    assert "placement" not in str(Policy())
    p = Policy.parse("compute=bf16,target=cpu,placement=off")
    assert p.placement is False and str(p) == "compute=bf16,target=cpu,placement=off"
    assert Policy.parse(str(p)) == p
    q = Policy.parse("numerics=off,placement=off,fp32:head")
    assert Policy.parse(str(q)) == q and q.numerics is False and q.placement is False
    assert Policy.parse("numerics=off").placement is True  # independent of numerics
    assert Policy.parse("placement=on") == Policy()
    with pytest.raises(PolicyError, match="placement takes on or off"):
        Policy.parse("placement=maybe")


# -- hand-built graphs where placement provably helps ---------------------------------
class UpsampleConv(nn.Module):
    """FP32 input -> nearest upsample x4 (a follow op that enlarges 16x) -> conv (bf16)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=4, mode="nearest"))


def test_cast_moves_before_an_enlarging_follow_op():
    torch.manual_seed(0)
    model, x = UpsampleConv(), torch.randn(2, 4, 8, 8)
    off, on = plans(model, (x,))
    assert off.nodes["interpolate"].dtype == torch.float32
    assert changed(off, on) == {"interpolate"}
    p = on.nodes["interpolate"]
    assert (p.dtype, p.inputs, p.rule) == (DT, DT, "placement")
    assert "runs in bf16" in p.reason and "instead of" in p.reason
    # the input (no gradient) is cast instead of the 16x larger upsampled tensor: forward only
    small, big = x.numel(), x.numel() * 16
    gm_off, gm_on = rewrite(model, (x,), "placement=off"), rewrite(model, (x,))
    c_off, c_on = step_casts(lambda: gm_off(x)), step_casts(lambda: gm_on(x))
    assert c_on.n == c_off.n
    assert c_off.bytes - c_on.bytes == (big - small) * BF16
    assert "15 KiB" in p.reason  # (8192 - 512) * 2 bytes
    torch.testing.assert_close(gm_on(x), gm_off(x), rtol=0, atol=0)  # nearest: exact


class ConvPadHead(nn.Module):
    """conv (bf16) -> zero padding 8x8 -> 16x16 -> flatten -> head kept in FP32 by a user
    override: the enlarging follow ops move to FP32 so the small conv output is cast up, not
    the big one. (Zero padding's backward is a slice: exact in either dtype, unlike a
    ``repeat``, whose backward sums.)"""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 16 * 16, 10)

    def forward(self, x):
        return self.head(torch.flatten(F.pad(self.conv(x), (4, 4, 4, 4)), 1))


def grads_after_step(model, fn):
    model.zero_grad(set_to_none=True)
    out = fn()
    out.float().pow(2).mean().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_cast_moves_before_an_enlarging_op_into_fp32_with_its_gradient():
    torch.manual_seed(0)
    model, x = ConvPadHead().train(), torch.randn(2, 3, 8, 8)
    off, on = plans(model, (x,), "fp32:head")
    assert changed(off, on) == {"pad", "flatten"}
    assert all(on.nodes[n].rule == "placement" and on.nodes[n].dtype == torch.float32
               for n in ("pad", "flatten"))
    assert on.nodes["head"] == off.nodes["head"] and on.nodes["conv"] == off.nodes["conv"]
    gm_off, gm_on = rewrite(model, (x,), "fp32:head,placement=off"), rewrite(model, (x,),
                                                                             "fp32:head")
    model.zero_grad(set_to_none=True)
    c_off = step_casts(lambda: gm_off(x))
    model.zero_grad(set_to_none=True)
    c_on = step_casts(lambda: gm_on(x))
    small, big = 2 * 4 * 8 * 8, 2 * 4 * 16 * 16
    # forward: bf16 -> fp32 (4 bytes); backward: the gradient fp32 -> bf16 (2 bytes)
    assert c_off.bytes - c_on.bytes == (big - small) * (FP32 + BF16)
    assert c_on.n == c_off.n
    # padding and flatten are exact both ways: the same output and gradients
    out_off, g_off = grads_after_step(model, lambda: gm_off(x))
    out_on, g_on = grads_after_step(model, lambda: gm_on(x))
    assert torch.equal(out_on, out_off)
    assert all(torch.equal(g_on[n], g_off[n]) for n in g_off)


def test_a_promote_op_pins_its_inputs():
    """As in ConvPadHead, but a slice of the padded tensor also goes into torch.cat
    (autocast's promote list on CPU: the widest input dtype). Moving the slice to FP32 would
    turn the cat FP32, so it stays, and then moving the padding does not pay."""
    class WithCat(ConvPadHead):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            a = F.pad(self.conv(x), (4, 4, 4, 4))
            joined = torch.cat([a[:, 0, 0, :2], self.fc(a[:, 1, 1, :8])], 1)
            return self.head(torch.flatten(a, 1)) + joined

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    off, on = plans(WithCat(), (x,), "fp32:head")
    assert off.nodes["cat"].dtype == DT and off.nodes["cat"].rule == "autocast"
    assert changed(off, on) == set()


def test_a_moved_op_reuses_a_cast_made_for_another_consumer():
    """x is cast to bf16 for the conv anyway; x.flatten(1)[:, :8] feeds a bf16 Linear.
    Autocast casts the slice as well; run flatten and slice in bf16 on the cast x instead:
    one cast fewer (the slice's; model inputs need no gradient)."""
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            return self.conv(x).mean((2, 3)) + self.fc(x.flatten(1)[:, :8])

    torch.manual_seed(0)
    model, x = Reuse(), torch.randn(2, 3, 8, 8)
    off, on = plans(model, (x,))
    assert changed(off, on) == {"flatten", "getitem"}
    gm_off, gm_on = rewrite(model, (x,), "placement=off"), rewrite(model, (x,))
    c_off, c_on = step_casts(lambda: gm_off(x)), step_casts(lambda: gm_on(x))
    assert c_on.n == c_off.n - 1 and c_off.bytes - c_on.bytes == 2 * 8 * BF16
    torch.testing.assert_close(gm_on(x), gm_off(x), rtol=0, atol=0)


def test_one_cast_per_value_so_ties_keep_autocast():
    """relu of an FP32 input read by three bf16 convs: casting the input or the relu output
    costs the same (one cast each, shared by the three): nothing moves. Counting one cast per
    consumer edge would wrongly move the relu."""
    class Three(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (nn.Conv2d(4, 4, 1) for _ in range(3))

        def forward(self, x):
            r = F.relu(x)
            return self.a(r) + self.b(r) + self.c(r)

    x = torch.randn(2, 4, 8, 8)
    off, on = plans(Three(), (x,))
    assert changed(off, on) == set()
    assert on.nodes["relu"].rule == "autocast" and on.nodes["relu"].dtype == torch.float32


# -- what must not move ---------------------------------------------------------------
class UpsampleTwoReaders(nn.Module):
    """The upsampled FP32 value is read by a bf16 conv and by ``reader``."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(32, 32)
        self.reader = reader

    def forward(self, x):
        y = F.interpolate(x, scale_factor=4, mode="nearest")
        out = self.conv(y)
        if self.reader == "compare":  # a comparison depends on y's dtype
            out = out * (y > 0.3)
        elif self.reader == "fp32":  # a head in FP32 (override) reads y: it keeps precision
            out = out + self.head(y)
        elif self.reader == "inplace":  # y changed in place
            y.mul_(2.0)
            out = out + self.conv(y)
        elif self.reader in ("slice", "fp32-slice"):  # the head reads a (small) slice of y
            out = out + self.head(y[:, :, :1, :])
        return out


def test_a_shrinking_follow_op_moves_with_its_input():
    """y (upsampled, FP32) is read by a bf16 conv and, through a slice 32x smaller, by a bf16
    Linear: autocast casts y and the slice; placement casts only the input x."""
    torch.manual_seed(0)
    model, x = UpsampleTwoReaders("slice"), torch.randn(2, 4, 8, 8)
    off, on = plans(model, (x,))
    assert changed(off, on) == {"interpolate", "getitem"}
    gm_off, gm_on = rewrite(model, (x,), "placement=off"), rewrite(model, (x,))
    c_off, c_on = step_casts(lambda: gm_off(x)), step_casts(lambda: gm_on(x))
    y, piece = x.numel() * 16, x.numel() * 16 // 32
    assert c_off.bytes - c_on.bytes == (y + piece - x.numel()) * BF16
    assert c_on.n == c_off.n - 1
    # same values in; the Linear reads a strided bf16 slice instead of a contiguous copy,
    # which may change its kernel's summation order (1 bf16 ulp)
    torch.testing.assert_close(gm_on(x), gm_off(x), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("reader", ["compare", "fp32", "inplace", "fp32-slice"])
def test_dtype_sensitive_readers_pin_the_value(reader):
    torch.manual_seed(0)
    model, x = UpsampleTwoReaders(reader), torch.randn(2, 4, 8, 8)
    policy = "fp32:head" if reader.startswith("fp32") else ""
    off, on = plans(model, (x,), policy)
    assert changed(off, on) == set()
    assert on.nodes["interpolate"].dtype == torch.float32
    want = rewrite(model, (x,), ",".join(filter(None, [policy, "placement=off"])))(x)
    torch.testing.assert_close(rewrite(model, (x,), policy or None)(x), want, rtol=0, atol=0)


def test_a_view_of_a_value_changed_in_place_keeps_aliasing():
    """expand of x is read by a conv before and after x changes in place: the second conv
    must see the change through the view, so the (enlarging) expand may not move."""
    class Mutated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, inp):
            x = inp * 1.0
            y = x.expand(4, -1, -1, -1)
            a = self.conv(y)
            x.mul_(2.0)
            return a + self.conv(y)

    x = torch.randn(1, 4, 8, 8)
    off, on = plans(Mutated(), (x,))
    assert changed(off, on) == set()
    model = Mutated()
    torch.testing.assert_close(rewrite(model, (x,))(x.clone()),
                               rewrite(model, (x,), "placement=off")(x.clone()),
                               rtol=0, atol=0)


def test_shape_reads_do_not_pin():
    class ShapeRead(UpsampleConv):
        def forward(self, x):
            y = F.interpolate(x, scale_factor=4, mode="nearest")
            return self.conv(y) / y.shape[-1]

    torch.manual_seed(0)
    off, on = plans(ShapeRead(), (torch.randn(2, 4, 8, 8),))
    assert changed(off, on) == {"interpolate"}


def test_arithmetic_follow_ops_do_not_move_into_the_low_dtype():
    """x + x is FP32 and stays so (rounding after an add differs from rounding before);
    the exact upsample after it moves to bf16."""
    class AddUp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(F.interpolate(x + x, scale_factor=4, mode="nearest"))

    x = torch.randn(2, 4, 8, 8)
    off, on = plans(AddUp(), (x,))
    assert changed(off, on) == {"interpolate"}
    assert on.nodes["add"] == off.nodes["add"] and on.nodes["add"].dtype == torch.float32

    class Broadcast(nn.Module):  # a + b broadcasts to 32x32: casting a and b would be cheaper
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, a, b):
            return self.conv(a + b)

    inputs = (torch.randn(2, 4, 1, 32), torch.randn(2, 4, 32, 1))
    off, on = plans(Broadcast(), inputs)
    assert changed(off, on) == set()


def test_explicit_dtype_calls_and_batchnorm_are_not_free():
    """``.float()`` / ``.to(dtype)`` and a BatchNorm (FP32 running stats) never move. (The
    norm has no affine weights, so the repeat after it needs no gradient and may move.)"""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(4, affine=False)
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.bn(x.float().repeat(1, 1, 4, 4))
            return self.conv(y.to(torch.float32).repeat(1, 1, 2, 2))

    x = torch.randn(2, 4, 4, 4)
    off, on = plans(M().eval(), (x,))
    moved = changed(off, on)
    assert moved == {"repeat_1"}, moved  # only the repeat before the conv is free
    assert all(on.nodes[n] == off.nodes[n] for n in ("float_1", "bn", "to", "repeat"))


class RelPosBiasAttention(nn.Module):
    """Attention with a relative-position bias table read through a repeated index, as in
    timm's BEiT and Swin: ``table[index.view(-1)]`` (each of the 7x7 table's rows is read by
    up to 16 of the 256 query-key pairs) is the attention mask of the bf16
    scaled_dot_product_attention. ``use`` picks how the table is read: a gather, or an
    ``expand`` / ``repeat`` of it (their backward sums as well)."""

    def __init__(self, use: str = "gather", dim: int = 32, heads: int = 4, ws: int = 4,
                 table_grad: bool = True) -> None:
        super().__init__()
        self.use, self.heads, self.n = use, heads, ws * ws
        self.table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads),
                                  requires_grad=table_grad)
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws),
                                            indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("index", rel[..., 0] * (2 * ws - 1) + rel[..., 1],
                             persistent=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        if self.use == "gather":
            bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        elif self.use == "expand":
            bias = self.table[:n].t().unsqueeze(-1).expand(-1, -1, n)
        else:
            bias = self.table[:n].t().unsqueeze(-1).repeat(1, 1, n)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.contiguous().unsqueeze(0))
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def autocast_and_fxamp_step(model, x, policy=None):
    """One training step of a deepcopy of ``model`` under autocast and of the rewritten
    ``model``: (loss, gradients by name) for each."""
    import copy
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=DT):
        ref_loss = ref(x).float().pow(2).mean()
    ref_loss.backward()
    loss = rewrite(model, (x,), policy)(x).float().pow(2).mean()
    loss.backward()
    return ((ref_loss, {n: p.grad for n, p in ref.named_parameters()}),
            (loss, {n: p.grad for n, p in model.named_parameters()}))


@pytest.mark.parametrize("use", ["gather", "expand", "repeat"])
def test_a_weight_read_through_a_summing_op_keeps_autocasts_gradient(use):
    """The bias table is FP32 and the attention reads its gathered (or expanded) copy in
    bf16. Casting the table before the gather moves fewer bytes, but the gather's backward
    then sums the gradients of repeated rows in bf16, where autocast sums them in FP32 and
    casts after: the table's gradient differs. The gather stays FP32, as under autocast, and
    the training step is bit-identical."""
    torch.manual_seed(0)
    model, x = RelPosBiasAttention(use), torch.randn(2, 16, 32)
    off, on = plans(model, (x,))
    assert changed(off, on) == set()
    reader = {"gather": "getitem_6", "expand": "expand", "repeat": "repeat"}[use]
    assert on.nodes[reader].dtype == torch.float32 and on.nodes[reader].rule == "autocast"
    (ref_loss, ref_grads), (loss, grads) = autocast_and_fxamp_step(model, x)
    assert torch.equal(loss, ref_loss)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), \
            (name, float((grads[name] - ref_grads[name]).abs().max()))


def test_a_gather_of_a_table_without_gradient_still_moves():
    """The same table frozen (no gradient): the gather is exact in either dtype, so the
    small table is cast before it, and the output is autocast's."""
    torch.manual_seed(0)
    model, x = RelPosBiasAttention(table_grad=False).eval(), torch.randn(2, 16, 32)
    off, on = plans(model, (x,))
    assert {"getitem_6", "view", "permute_1"} <= changed(off, on)
    assert on.nodes["getitem_6"].rule == "placement" and on.nodes["getitem_6"].dtype == DT
    with torch.no_grad(), torch.autocast("cpu", dtype=DT):
        want = model(x)
    with torch.no_grad():
        assert torch.equal(rewrite(model, (x,))(x), want.float())


def test_a_repeat_of_a_low_precision_input_keeps_autocasts_gradient():
    """A bf16 model input is an activation (the graph of a child of a rewritten model gets
    the bf16 values of the layers before it), so it needs a gradient: its repeat into an
    FP32 loss stays bf16, as under autocast, and the input's gradient is autocast's."""
    class RepeatLoss(nn.Module):
        def forward(self, x, y):
            return F.mse_loss(x.repeat(1, 4), y)

    torch.manual_seed(0)
    x, y = torch.randn(4, 64).to(DT), torch.randn(4, 256)
    off, on = plans(RepeatLoss(), (x, y))
    assert changed(off, on) == set()
    gm = rewrite(RepeatLoss(), (x, y))
    want_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=DT):
        want = RepeatLoss()(want_x, y)
    want.backward()
    got = gm(got_x, y)
    got.backward()
    assert torch.equal(got, want) and torch.equal(got_x.grad, want_x.grad)


@pytest.mark.parametrize("call, sums", [
    (lambda x, i: x[i], True),                          # a gather: rows may repeat
    (lambda x, i: x[:, :4], False),                     # slicing
    (lambda x, i: x[None, 1:], False),
    (lambda x, i: x.expand(3, -1, -1, -1), True),       # a broadcast
    (lambda x, i: x.repeat(1, 1, 2, 2), True),
    (lambda x, i: x.permute(0, 2, 3, 1), False),
    (lambda x, i: F.interpolate(x, scale_factor=2), True),
    (nn.Upsample(scale_factor=2), True),
    (nn.MaxPool2d(2), False),                           # windows side by side
    (nn.MaxPool2d(3, 2, 1), True),                      # windows overlap
    (lambda x, i: F.max_pool2d(x, 2), False),
    (lambda x, i: F.max_pool2d(x, (3, 3), (1, 1)), True),
    (nn.AdaptiveMaxPool2d(3), True),
    (nn.ReLU(), False),
])
def test_sums_gradients_names_the_ops_whose_backward_sums(call, sums):
    from fxamp.passes.placement.free import free_kind, sums_gradients

    class Call(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.op = call if isinstance(call, nn.Module) else None

        def forward(self, x, i):
            return self.op(x) if self.op is not None else call(x, i)

    gm = torch.fx.symbolic_trace(Call())
    node = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")][-1]
    assert free_kind(node, gm) is not None, node.format_node()
    assert sums_gradients(node, gm) is sums, node.format_node()


@pytest.mark.slow
def test_timm_beit_training_step_equals_autocast():
    """timm's BEiT (a tiny config, random weights) reads its relative-position bias table
    through ``relative_position_index.view(-1)``: one training step is bit-identical to
    autocast's, the tables' gradients included."""
    import timm
    torch.manual_seed(0)
    model = timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=10).train()
    assert model.blocks[0].attn.relative_position_bias_table.requires_grad
    x = torch.randn(2, 3, 32, 32)
    (ref_loss, ref_grads), (loss, grads) = autocast_and_fxamp_step(model, x)
    assert torch.equal(loss, ref_loss)
    differ = [n for n in ref_grads if not torch.equal(grads[n], ref_grads[n])]
    assert differ == []


# -- real models: fixed nodes never change, outputs agree, casts not above autocast ----
class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.enc(x).mean(dim=1))


def _vit():
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2,
                                                num_heads=2, hidden_dim=32, mlp_dim=64,
                                                num_classes=10)


def _upsampled_resnet():
    return nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                         torchvision.models.resnet18(num_classes=10))


MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (2, 3, 64, 64)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
                           (2, 3, 64, 64)),
    "vit": (_vit, (2, 3, 32, 32)),
    "transformer": (TinyTransformer, (2, 8, 32)),
    "upsample+resnet18": (_upsampled_resnet, (2, 3, 32, 32)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_real_models_fixed_nodes_never_change_and_outputs_agree(name):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model, x = make().eval(), torch.randn(*shape)
    for policy in ("", "numerics=off"):
        off, on = plans(model, (x,), policy)
        assert list(off.nodes) == list(on.nodes)
        for n in changed(off, on):
            assert on.nodes[n].rule == "placement", (n, on.nodes[n])
            assert off.nodes[n].rule == "autocast" and off.nodes[n].reason == FOLLOW, n
    moved = changed(off, on)
    if name == "upsample+resnet18":
        assert moved == {"_0"}  # the input upsample runs in bf16 before the first conv
    want = rewrite(model, (x,), "placement=off")(x)
    got = rewrite(model, (x,))(x)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["transformer", pytest.param("vit", marks=pytest.mark.slow),
                                  pytest.param("upsample+resnet18", marks=pytest.mark.slow)])
def test_casts_per_step_not_above_autocast(name):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model, x = make().train(), torch.randn(*shape)
    gm = rewrite(model, (x,), "numerics=off")

    def autocast_forward():
        with torch.autocast("cpu", dtype=DT):
            return model(x)

    model.zero_grad(set_to_none=True)
    ref = step_casts(autocast_forward)
    model.zero_grad(set_to_none=True)
    got = step_casts(lambda: gm(x))
    assert ref.n > 0
    assert got.n <= ref.n and got.bytes <= ref.bytes, (got.n, ref.n, got.bytes, ref.bytes)
    if name == "upsample+resnet18":  # the 3x32x32 input is cast instead of the 3x64x64
        assert ref.bytes - got.bytes == 2 * 3 * (64 * 64 - 32 * 32) * BF16
