"""The tools that read a rewritten model (``fxamp.audit``, a flat ``amp_rewrite`` with an
example, ``export_onnx``, ``fxamp.train.localize``, ``fxamp.search``, ``bisect_baseline``) on
a model in block mode (``amp_rewrite(model, config=..., inplace=True)`` without example
inputs, ``rewriter/blocks.py``). Each works on the model's FP32 form (a shadow with its own
forwards back) or replays its blocks' graphs, and leaves the model in block mode: after the
tool ran, the model still trains bit for bit like the same model under torch.autocast."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.rewriter.overlap import is_blocks
from fxamp.train import localize

BF16, FP16 = torch.bfloat16, torch.float16
X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (10,), generator=torch.Generator().manual_seed(2))


class Block(nn.Module):
    """One FP32 normed value read by three Linears (its one cast shared by them:
    ``runtime.fan_out``)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.float())
        att = torch.softmax(self.q(h) @ self.k(h).transpose(-2, -1) / 4.0, dim=-1)
        return x + self.fc(att @ self.v(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _loss(model, x=X):
    return F.cross_entropy(model(x).flatten(0, 1).float(), Y)


def _config(dtype=BF16):
    return fxamp.RewriteConfig.make(dtype=dtype, target="cpu")


def _models(dtype=BF16, called=True):
    """(the FP32 reference, a copy in block mode, called once when ``called``)."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    assert fxamp.amp_rewrite(model, config=_config(dtype), inplace=True) is model
    assert is_blocks(model)
    if called:
        with torch.no_grad():
            model(X)
    return ref, model


def _trains_like_autocast(model, ref, dtype=BF16):
    """The model is still in block mode and one training step of it equals the reference's
    under torch.autocast, loss and every gradient bit for bit."""
    assert is_blocks(model)
    got = []
    for m, autocast in ((model, False), (ref, True)):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss = _loss(m)
        loss.backward()
        got.append((loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}))
        m.zero_grad(set_to_none=True)
    (loss, grads), (ref_loss, ref_grads) = got
    assert torch.equal(loss, ref_loss)
    assert [k for k in grads if not torch.equal(grads[k], ref_grads[k])] == []


# -- 1. audit and a flat rewrite with an example ----------------------------------------
def test_audit_of_a_block_mode_model_keeps_its_blocks_and_reports_the_fp32_models_findings():
    ref, model = _models()
    findings = fxamp.audit(model, X, config=_config())
    assert list(map(str, findings)) == list(map(str, fxamp.audit(copy.deepcopy(ref), X,
                                                                 config=_config())))
    _trains_like_autocast(model, ref)


def test_a_flat_rewrite_with_an_example_of_a_block_mode_model_keeps_its_blocks():
    ref, model = _models()
    gm = fxamp.amp_rewrite(model, X, _config())
    assert is_blocks(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        want = ref(X)
    with torch.no_grad():
        assert torch.equal(gm(X), want)
    _trains_like_autocast(model, ref)


# -- 2. export_onnx ------------------------------------------------------------------------
def test_export_onnx_of_a_block_mode_model_exports_a_flat_rewrite_and_keeps_its_blocks(
        tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from fxamp.export import export_onnx

    ref, model = _models(FP16)
    path = export_onnx(model, (X,), str(tmp_path / "net.onnx"))
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert meta["fxamp.checked_inputs"] != "0"  # (checked against PyTorch by the export)
    assert "blocks.1.q" in meta["fxamp.plan"]  # (one flat graph: every block's nodes)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: X.numpy()})
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        want = ref(X).float()
    assert torch.allclose(torch.from_numpy(got).float(), want, atol=2e-2, rtol=2e-2)
    _trains_like_autocast(model, ref, FP16)


@pytest.mark.slow  # (transformers' import, three exports)
def test_a_block_planned_gpt2_exports_the_flat_ones_file_and_report(tmp_path):
    """GPT-2 with a deployment policy, planned in block mode (lazily, and with
    ``partition="blocks"`` on the example), exports the same file, byte for byte, as the
    flat rewrite of the same model, and its precision report (the plan the file holds) is
    the same. With ``partition="blocks"`` the export failed (the flat rewrite was asked for
    the config's partition, which keeps the module tree)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    from fxamp.export import export_onnx, precision_report

    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64, bos_token_id=0, eos_token_id=0,
                                  use_cache=False)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    made = {}
    for how in ("flat", "lazy", "blocks"):
        model = copy.deepcopy(base)
        config = fxamp.RewriteConfig.make(policy="tensorrt",
                                          partition="blocks" if how == "blocks" else "auto")
        if how == "flat":
            model = fxamp.amp_rewrite(model, (ids,), config)
        elif how == "lazy":
            fxamp.amp_rewrite(model, config=config, inplace=True)
            with torch.no_grad():
                model(ids)
        else:
            fxamp.amp_rewrite(model, (ids,), config, inplace=True)
        assert is_blocks(model) == (how != "flat")
        (tmp_path / how).mkdir()
        path = export_onnx(model, (ids,), str(tmp_path / how / "gpt2.onnx"))
        with open(path, "rb") as f:
            made[how] = (f.read(), precision_report(path, backend="onnxruntime",
                                                    inputs=(ids,)).to_markdown())
        assert is_blocks(model) == (how != "flat")  # (the model keeps its block mode)
    assert made["lazy"] == made["flat"] and made["blocks"] == made["flat"]


def test_export_onnx_of_a_flat_in_place_model_exports_the_graph_it_computes_with(tmp_path):
    """The graph itself goes to the dynamo exporter (the model whose forward calls it is
    no graph: torch.export failed on it, and the TorchScript fallback traced it)."""
    onnx = pytest.importorskip("onnx")
    from fxamp.export import export_onnx

    torch.manual_seed(0)
    model = Net()
    fxamp.amp_rewrite(model, X, _config(FP16).replace(partition="flat"), inplace=True)
    path = export_onnx(model, (X,), str(tmp_path / "net.onnx"))
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert meta["fxamp.exporter"] == "dynamo" and "fxamp.dynamo_error" not in meta
    assert fxamp.rewritten(model) is not model  # (still rewritten in place)


# -- 3. localize ---------------------------------------------------------------------------
def test_localize_replays_the_blocks_graphs_and_names_the_block_node_that_overflows():
    ref, model = _models(FP16)
    seen = []

    def loss_fn(m, x):
        loss = _loss(m, x)
        seen.append(loss.detach())
        return loss

    found = localize(model, loss_fn, X)
    assert found.phase == "none"
    with torch.autocast("cpu", dtype=FP16):
        assert torch.equal(seen[0], _loss(ref).detach())  # (the replay computes as it runs)
    weight = model.blocks[1].q.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1e5)  # (its output overflows fp16, not fp32)
    try:
        found = localize(model, _loss, X)
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert found.phase == "forward", found
    assert found.node.startswith("blocks.1/") and found.module == "blocks.1.q", found
    assert found.dtype == FP16 and found.forward_node.startswith("blocks.1/")
    _trains_like_autocast(model, ref, FP16)


def test_localize_of_a_block_mode_model_not_called_yet_says_to_run_it_first():
    ref, model = _models(called=False)
    with pytest.raises(fxamp.FxampError, match=r"blocks\.0 .*not called yet.*what to do: run "
                                               r"the model once"):
        localize(model, _loss, X)
    _trains_like_autocast(model, ref)


@pytest.mark.parametrize("inplace", [False, True])
def test_localize_of_a_flat_rewrite_skips_the_gradients_autograd_leaves_undefined(inplace):
    """A cast shared by several consumers (``runtime.fan_out``) gets no gradient of its
    own: its hook is called with None. A flat in-place model replays its graph."""
    torch.manual_seed(0)
    net = Net()
    gm = fxamp.amp_rewrite(net, X, _config().replace(partition="flat"), inplace=inplace)
    assert any("fan_out" in str(n.target) for n in fxamp.rewritten(gm).graph.nodes)
    assert localize(gm, _loss, X).phase == "none"


# -- 4. search and bisect_baseline ---------------------------------------------------------
@pytest.mark.parametrize("tool", ["search", "bisect_baseline"])
def test_search_of_a_block_mode_model_measures_against_fp32_and_keeps_its_blocks(tool):
    ref, model = _models()
    run = getattr(fxamp, tool)
    got = run(model, X, [X], rtol=0.5, config=_config())
    want = run(copy.deepcopy(ref), X, [X], rtol=0.5, config=_config())
    assert got.error == want.error > 0  # (the FP32 model's outputs are the reference)
    assert got.fp32_nodes == want.fp32_nodes
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        assert torch.equal(got.graph_module(X), ref(X))
    _trains_like_autocast(model, ref)


def _asked_in(names: set) -> dict:
    """The src modules that call any of ``names``, each with its count of calls."""
    import ast
    import pathlib
    root = pathlib.Path(fxamp.__file__).parent
    found: dict = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in names:
                key = path.relative_to(root).as_posix()
                found[key] = found.get(key, 0) + 1
    return found


def test_which_shape_a_rewrite_has_is_asked_in_one_module():
    """Issue 49's count: the code that asks whether a model is in block mode or rewritten in
    place with one graph is ``rewriter/overlap.py``, which answers the tools with what they
    need (its FP32 form, its one graph, a rewrite over it); ``train/localize.py`` asks once,
    for the stand-in that replays the model."""
    found = _asked_in({"is_blocks", "is_inplace"})
    assert set(found) == {"rewriter/overlap.py", "train/localize.py"}, found
    assert found["train/localize.py"] == 1
