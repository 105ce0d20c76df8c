"""Front ends: torch.export (ATen graphs), the auto fallback chain and partial tracing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.errors import FxampError, TraceError
from fxamp.frontends.aten import export_trace, flat_inputs

from autocast_truth import record_autocast_dtypes

BF16 = dict(dtype=torch.bfloat16, target="cpu")


class KwargsDict(nn.Module):
    """Keyword arguments, an optional mask, a shape-dependent view and a dict output:
    torch.fx cannot take the ``if mask is not None`` branch on a Proxy-free path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
        h = self.drop(self.bn(self.lin(x)))
        h = h.view(h.shape[0], 2, 4).flatten(1)
        if mask is not None:
            h = h * mask
        return {"logits": self.head(h), "probs": torch.softmax(h, -1)}


def _kwargs_model() -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return KwargsDict(), (torch.randn(4, 8),), {"mask": torch.ones(4, 8)}


def test_export_frontend_kwargs_dict_output_and_other_batch_sizes() -> None:
    model, args, kwargs = _kwargs_model()
    model.eval()
    gm = fxamp.amp_rewrite(model, args,
                           fxamp.RewriteConfig.make(example_kwargs=kwargs, frontend="export",
                                                    **BF16))
    plan = fxamp.plan_of(gm)
    assert plan.header["frontend"] == "export"
    # plan lines name ATen ops and the source module paths
    assert plan.nodes["linear"].op == "aten.linear"
    assert plan.nodes["linear"].module == "lin"
    assert plan.nodes["linear"].dtype == torch.bfloat16
    for batch in (4, 7):  # dimensions stay symbolic: another batch size runs
        x = torch.randn(batch, 8)
        out, ref = gm(x, mask=torch.ones(batch, 8)), model(x, mask=torch.ones(batch, 8))
        assert set(out) == {"logits", "probs"}
        assert out["logits"].dtype == torch.float32  # policy output=fp32
        # bf16 keeps 8 bits of mantissa: two chained bf16 linears stay within ~2 %
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=0.03, atol=0.03)
    # the model's own Parameters, not copies
    ours = dict(gm.named_parameters())
    for name, p in model.named_parameters():
        assert ours[name] is p


def test_export_graph_follows_train_and_eval() -> None:
    model, args, kwargs = _kwargs_model()
    model.train()
    gm = fxamp.amp_rewrite(model, args,
                           fxamp.RewriteConfig.make(example_kwargs=kwargs, frontend="export",
                                                    **BF16))
    x, mask = torch.randn(16, 8), torch.ones(16, 8)
    count = int(model.bn.num_batches_tracked)
    gm.train()
    a, b = gm(x, mask=mask)["logits"], gm(x, mask=mask)["logits"]
    assert not torch.equal(a, b)  # dropout is active in train mode
    assert int(model.bn.num_batches_tracked) == count + 2
    a.sum().backward()
    assert model.lin.weight.grad is not None and model.lin.weight.grad.dtype == torch.float32
    gm.eval()
    model.eval()
    c, d = gm(x, mask=mask)["logits"], gm(x, mask=mask)["logits"]
    assert torch.equal(c, d)  # no dropout, running statistics used
    assert int(model.bn.num_batches_tracked) == count + 2  # eval does not count batches
    torch.testing.assert_close(c, model(x, mask=mask)["logits"], rtol=0.03, atol=0.03)


class Gate(nn.Module):
    """Data-dependent (neither fx nor torch.export takes it) and without child modules, so
    nothing in it can be rewritten: it runs under torch.autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 8 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x @ self.w
        return -(x @ self.w)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.gate = Gate()
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.gate(self.a(x))))


def test_fx_error_names_module_line_and_the_way_out() -> None:
    with pytest.raises(TraceError) as info:
        fxamp.amp_rewrite(Gated(), (torch.randn(4, 8),),
                          fxamp.RewriteConfig.make(frontend="fx", **BF16))
    text = str(info.value)
    assert "module: gate" in text
    assert "if x.sum() > 0" in text and "test_frontends.py" in text
    assert "frontend='export'" in text and "frontend='auto'" in text


def test_export_error_names_the_data_dependent_line() -> None:
    with pytest.raises(TraceError) as info:
        fxamp.amp_rewrite(Gated(), (torch.randn(4, 8),),
                          fxamp.RewriteConfig.make(frontend="export", **BF16))
    text = str(info.value)
    assert "torch.export cannot export Gated" in text
    assert "if x.sum() > 0" in text and "module: gate" in text


def test_auto_traces_around_a_data_dependent_submodule() -> None:
    torch.manual_seed(0)
    model = Gated()
    x = torch.randn(4, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    plan = fxamp.plan_of(gm)
    assert plan.header["frontend"] == "fx+runtime"
    assert plan.header["runtime leaves"] == "gate"
    assert plan.nodes["gate"].rule == "runtime"
    assert plan.nodes["a"].dtype == plan.nodes["b"].dtype == torch.bfloat16
    for sign in (1.0, -1.0):  # both branches, decided at run time
        xs = sign * x.abs()
        torch.testing.assert_close(gm(xs), model(xs), rtol=0.03, atol=0.03)
    # it trains with the scaler's usual loop (bf16 needs no scaling; loss stays finite)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.gate.w.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        loss = gm(torch.randn(4, 8)).float().pow(2).mean()
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
    assert not torch.equal(before, model.gate.w)


class RootBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_no_front_end_takes_a_branch_in_the_root_forward() -> None:
    with pytest.raises(TraceError) as info:
        fxamp.amp_rewrite(RootBranch(), (torch.randn(2, 8),), fxamp.RewriteConfig.make(**BF16))
    text = str(info.value)
    assert "no front end takes RootBranch" in text
    assert "- fx:" in text and "- export:" in text


def test_auto_prefers_fx_and_records_it() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    gm = fxamp.amp_rewrite(model, (torch.randn(2, 8),), fxamp.RewriteConfig.make(**BF16))
    assert fxamp.plan_of(gm).header["frontend"] == "fx"
    assert "frontend: fx" in fxamp.plan_of(gm).to_text()


def test_bad_frontend_and_missing_inputs() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(FxampError, match="unknown frontend 'onnx'"):
        fxamp.amp_rewrite(model, (torch.randn(2, 4),), fxamp.RewriteConfig.make(frontend="onnx"))
    with pytest.raises(FxampError, match="needs example_inputs"):
        fxamp.amp_rewrite(model, config=fxamp.RewriteConfig.make(frontend="export"))


class HandWritten(nn.Module):
    """Numerics patterns on an ATen graph: hand-written softmax, tiny LayerNorm eps, loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8, eps=1e-12)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.lin(x))
        e = torch.exp(h)
        p = e / e.sum(-1, keepdim=True)
        return F.mse_loss(p, y)


def test_numerics_passes_run_on_export_graphs() -> None:
    torch.manual_seed(0)
    model = HandWritten()
    args = (torch.randn(4, 8), torch.rand(4, 8))
    gm = fxamp.amp_rewrite(model, args,
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda",
                                                    frontend="export"))
    rules = {p.rule for p in fxamp.plan_of(gm).nodes.values()}
    by_op = {p.op: p for p in fxamp.plan_of(gm).nodes.values()}
    assert "softmax" in rules  # exp / sum / div became a stable softmax
    assert by_op["aten.layer_norm"].dtype == torch.float32
    assert by_op["aten.mse_loss"].dtype == torch.float32
    torch.testing.assert_close(gm(*args), model(*args), rtol=0.02, atol=1e-3)


def _agreement_models() -> list:
    import torchvision

    torch.manual_seed(0)
    return [
        ("resnet18", torchvision.models.resnet18(weights=None).eval(),
         (torch.randn(2, 3, 64, 64),), {}),
        ("kwargs_dict", _kwargs_model()[0].eval(), _kwargs_model()[1], _kwargs_model()[2]),
        ("handwritten", HandWritten(), (torch.randn(4, 8), torch.rand(4, 8)), {}),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_export_plans_agree_with_autocast_on_aten_graphs(target: str) -> None:
    """With the numerics passes off, every node of an exported graph gets the dtype that
    torch.autocast gives the same ATen op (run node by node; CUDA on fake tensors)."""
    for name, model, args, kwargs in _agreement_models():
        dtype = torch.bfloat16 if target == "cpu" else torch.float16
        gm = fxamp.amp_rewrite(model, args,
                               fxamp.RewriteConfig.make(example_kwargs=kwargs, dtype=dtype,
                                                        target=target,
                                                        policy="numerics=off",
                                                        frontend="export"))
        src = export_trace(model, args, kwargs)
        truth = record_autocast_dtypes(src, flat_inputs(src, args, kwargs), target, dtype)
        plan = fxamp.plan_of(gm).nodes
        checked = [n for n in truth if n in plan]
        assert len(checked) > 5, name
        wrong = {n: (plan[n].dtype, truth[n]) for n in checked if plan[n].dtype != truth[n]}
        assert not wrong, f"{name}: {wrong}"


class ShapeBranch(nn.Module):
    """torch.fx cannot branch on a shape; torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 8:
            return torch.relu(self.lin(x))
        return x


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shape = ShapeBranch()
        self.gate = Gate()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.shape(x)))


def test_partial_tracing_rewrites_a_leaf_on_its_own_where_it_can() -> None:
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(4, 8)
    gm = fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(**BF16))
    plan = fxamp.plan_of(gm)
    assert plan.header["frontend"] == "fx+runtime"
    assert plan.header["runtime leaves"] == "gate"  # data-dependent: autocast at run time
    assert plan.header["nested"] == "shape=export"  # exportable: rewritten on its own
    assert plan.nodes["shape"].rule == "nested"
    assert plan.nodes["shape/linear"].dtype == torch.bfloat16
    assert plan.nodes["shape/linear"].module == "shape.lin"
    assert plan.nodes["gate"].rule == "runtime"
    torch.testing.assert_close(gm(x), model(x), rtol=0.03, atol=0.03)
    assert "shape/linear" in fxamp.Plan.from_text(plan.to_text()).nodes


class ListRoot(nn.Module):
    """A detection-like root: loops over a list of images and branches on a value in its
    own forward (no tracer takes it); its children are ordinary graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.gate = Gate()
        self.head = nn.Linear(8, 2)

    def forward(self, images: list) -> list:
        out = []
        for img in images:
            feats = self.gate(self.backbone(img[None]))
            if feats.abs().sum() > 0:
                out.append({"scores": self.head(feats)})
        return out


def test_untraceable_root_runs_eager_with_its_children_rewritten() -> None:
    torch.manual_seed(0)
    model = ListRoot()
    images = [torch.rand(3, 16, 16), torch.rand(3, 16, 20)]
    gm = fxamp.amp_rewrite(model, (images,), fxamp.RewriteConfig.make(**BF16))
    plan = fxamp.plan_of(gm)
    assert plan.header["frontend"] == "eager"
    assert plan.header["nested"] == "backbone=fx head=fx"
    assert plan.header["runtime leaves"] == "gate"
    assert plan.nodes["backbone"].op == "nn.Sequential"
    assert plan.nodes["backbone/_0"].dtype == torch.bfloat16  # the Conv2d
    assert plan.nodes["backbone/_0"].module == "backbone.0"
    assert plan.nodes["gate"].rule == "runtime"
    out, ref = gm(images), model(images)
    assert len(out) == len(ref) == 2
    for o, r in zip(out, ref):
        assert o["scores"].dtype == torch.float32  # policy output=fp32
        torch.testing.assert_close(o["scores"], r["scores"], rtol=0.03, atol=0.03)
    # the same Parameters, and the user's model is untouched
    assert gm.head is not model.head and isinstance(model.head, nn.Linear)
    assert dict(gm.named_parameters())["head.weight"] is model.head.weight
    gm(images)[0]["scores"].sum().backward()
    assert model.backbone[0].weight.grad.dtype == torch.float32


class Specialised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).reshape(4, 2, 4)  # the batch size is baked in


def test_export_keeps_its_shape_guard() -> None:
    """A dimension the code specialises stays guarded: another size raises, it does not
    run the specialised graph."""
    gm = fxamp.amp_rewrite(Specialised(), (torch.randn(4, 8),),
                           fxamp.RewriteConfig.make(frontend="export", **BF16))
    assert gm(torch.randn(4, 8)).shape == (4, 2, 4)
    with pytest.raises(Exception):
        gm(torch.randn(6, 8))


class Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0].sum()[None] + x.mean()


def test_export_refuses_value_dependent_sizes() -> None:
    with pytest.raises(TraceError, match="size that depends on tensor values"):
        fxamp.amp_rewrite(Nonzero(), (torch.randn(4, 8),),
                          fxamp.RewriteConfig.make(frontend="export", **BF16))


@pytest.mark.slow
def test_onnx_export_of_an_export_front_end_graph(tmp_path) -> None:
    """An ATen-level graph (Hugging Face BERT, which only the export front end takes) goes
    to ONNX, and the precision report maps its layers back to the plan."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertModel

    from fxamp.export import export_onnx, precision_report

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (2, 8))
    gm = fxamp.amp_rewrite(model, (ids,),
                           fxamp.RewriteConfig.make(dtype=torch.float16, target="cuda"))
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    path = export_onnx(gm, (ids,), str(tmp_path / "bert.onnx"))
    report = precision_report(path, fxamp.plan_of(gm), inputs=(ids,))
    mapped = report.mapped
    assert len(mapped) >= 0.5 * len(report.layers) and len(mapped) > 10
    # what the plan says is what the ONNX graph holds, layer by layer
    both = [layer for layer in mapped if layer.planned and layer.exported]
    assert len(both) >= 0.8 * len(mapped)
    assert all(layer.exported == layer.planned for layer in both)
    matmuls = [layer for layer in mapped if layer.op_type in ("MatMul", "Gemm")]
    assert matmuls and all(layer.planned == "fp16" for layer in matmuls)
