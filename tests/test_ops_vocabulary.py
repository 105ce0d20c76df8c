"""fxamp.ops, the op vocabulary: one answer for an op whatever its spelling, on graphs made by
torch.fx.symbolic_trace and by torch.export (the front ends fxamp uses)."""
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxamp import ops


class Spellings(nn.Module):
    """The same ops written as functions, tensor methods and modules, and a loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4, eps=1e-3)
        self.bce = nn.BCELoss()

    def forward(self, x, y):
        h = self.norm(self.fc(x))
        a = torch.exp(h) + h.exp()
        b = F.layer_norm(a, (4,), eps=1e-7)
        p = torch.sigmoid(b)
        return F.binary_cross_entropy(p, y) + self.bce(p, y) + F.mse_loss(b, y)


def inputs():
    return torch.randn(2, 8), torch.rand(2, 4)


def fx_graph():
    return fx.symbolic_trace(Spellings())


def export_graph():
    return torch.export.export(Spellings(), inputs(), strict=False).module()


def calls(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def test_name_is_the_same_for_fx_and_aten_spellings():
    fx_exps = [n for n in calls(fx_graph()) if ops.name(n) == "exp"]
    assert {n.op for n in fx_exps} == {"call_function", "call_method"}  # torch.exp, x.exp()
    ex_exps = [n for n in calls(export_graph()) if ops.name(n) == "exp"]
    assert len(ex_exps) == 2 and all(ops.is_aten(n) for n in ex_exps)
    assert all(ops.aten_name(n) == "exp" for n in ex_exps)
    assert all(ops.aten_name(n) == "" for n in fx_exps)


def test_losses_are_known_in_every_spelling():
    gm = fx_graph()
    fx_losses = sorted(ops.label(n, gm) for n in calls(gm) if ops.is_loss(n, gm))
    assert fx_losses == ["F.binary_cross_entropy", "F.mse_loss", "nn.BCELoss"]
    ex = export_graph()
    ex_losses = sorted(ops.label(n, ex) for n in calls(ex) if ops.is_loss(n, ex))
    # torch.export calls the ATen ops; nn.BCELoss and F.binary_cross_entropy both become one
    assert ex_losses == ["aten.binary_cross_entropy", "aten.binary_cross_entropy",
                         "aten.mse_loss"]
    assert not any(ops.is_loss(n, ex) for n in calls(ex) if ops.name(n) in ("exp", "sigmoid"))


def test_modules_and_schema_arguments():
    gm = fx_graph()
    norm = next(n for n in calls(gm) if n.op == "call_module" and n.target == "norm")
    assert ops.is_module(norm, gm, nn.LayerNorm) and not ops.is_module(norm, gm, nn.Linear)
    assert ops.module_of(norm, gm) is gm.norm and ops.module_ops(gm.norm) == ("layer_norm",)
    assert ops.module_of(next(n for n in calls(gm) if n.op == "call_function"), gm) is None
    ln = next(n for n in calls(gm) if ops.is_call(n, (F.layer_norm,)))
    assert ops.arg(ln, "eps") == 1e-7
    assert ops.schema_arg(ln, ("eps",)) == (None, None)  # not an ATen overload
    ex = export_graph()
    eps = sorted(ops.schema_arg(n, ("eps", "epsilon"))[1] for n in calls(ex)
                 if ops.aten_name(n).startswith("layer_norm"))
    assert eps == [1e-7, 1e-3]  # given by position or keyword, read through the schema


def test_categories_for_each_target():
    gm = fx_graph()
    by_label = {ops.label(n, gm): n for n in calls(gm)}
    assert ops.category(by_label["nn.Linear"], gm, "cuda") == ops.LOWER
    assert ops.category(by_label["F.binary_cross_entropy"], gm, "cuda") == ops.BANNED
    assert ops.aten_category("binary_cross_entropy", "cuda") == ops.BANNED
    assert ops.category(by_label["torch.sigmoid"], gm, "cuda") == ops.FOLLOW
    category, op, label = ops.autocast_entry(by_label["F.layer_norm"], gm, "cuda")
    assert (category, op, label) == (ops.FP32, "layer_norm", "F.layer_norm")
    assert not any(ops.is_runtime(n, gm) for n in calls(gm))


def test_opaque_calls_are_runtime():
    class Opaque(nn.Module):
        def forward(self, x):
            return x + 1

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Opaque()

        def forward(self, x):
            return self.inner(x).relu()

    class Keep(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Opaque) or super().is_leaf_module(m, qualname)

    root = Outer()
    gm = fx.GraphModule(root, Keep().trace(root))
    inner = next(n for n in calls(gm) if n.op == "call_module")
    assert ops.is_runtime(inner, gm) and ops.category(inner, gm, "cuda") is None
    relu = next(n for n in calls(gm) if n.op == "call_method")
    assert not ops.is_runtime(relu, gm) and ops.label(relu, gm) == "Tensor.relu"
