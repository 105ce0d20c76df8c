"""amp_rewrite time vs torch.fx.symbolic_trace alone, on real models and synthetic chains.

Synthetic graphs: an nn.Module whose forward chains N blocks of Linear -> ReLU ->
LayerNorm-ish (x - mean) * rsqrt(var + eps) ... so the traced graph has ~``nodes_per_block``
nodes per block; sizes go 1k -> 3k -> 10k (-> 30k with --big) nodes. Per-node times show
whether the rewrite grows linearly.

Models torch.fx cannot trace (timm; the export front end takes them): plain
``torch.export.export(m, (x,), strict=False)`` with static shapes against ``amp_rewrite``
(which exports with the batch dimension dynamic, plus, for models that read ``training``,
a static eval-mode export to follow train()/eval()), interleaved, medians.

    python benchmarks/rewrite_time.py [--big] [--repeat 3] [--export-models NAME:SIZE,...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fxamp  # noqa: E402


class Chain(nn.Module):
    """N blocks of Linear, ReLU, a hand-written LayerNorm (mean/var/rsqrt) and a residual."""

    def __init__(self, blocks: int, dim: int = 8) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = torch.relu(lin(x))
            mu = h.mean(-1, keepdim=True)
            var = ((h - mu) ** 2).mean(-1, keepdim=True)
            x = x + (h - mu) * torch.rsqrt(var + 1e-5)
        return x


def timed(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    return statistics.median(ts)


EXPORT_MODELS = ("maxvit_tiny_tf_224:224,mobilevit_xxs:64,tiny_vit_5m_224:64,"
                 "twins_svt_small:64")
#: deep models torch.fx takes (hundreds of modules, many batch norms), rewritten in train
#: mode with the default front end, against one plain torch.export
FX_MODELS = "inception_v4:299,inception_resnet_v2:299,dpn68:224,halonet26t:256"


def export_rows(spec: str, repeat: int, frontend: str = "export", train: bool = False) -> list:
    """[model, nodes, plain export s, amp_rewrite s, ratio, exports per rewrite] for each
    NAME:SIZE in ``spec``, plain export and rewrite (with ``frontend``, the model in train
    mode where ``train``) interleaved ``repeat`` times."""
    import timm

    rows = []
    for item in filter(None, spec.split(",")):
        name, size = item.split(":")
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False).train(train)
        x = torch.randn(2, 3, int(size), int(size))
        real = torch.export.export
        calls = []

        def counting(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        plain, rew = [], []
        nodes = 0
        for _ in range(repeat):
            t0 = time.process_time()
            ep = real(model, (x,), strict=False)
            plain.append(time.process_time() - t0)
            nodes = len(ep.graph.nodes)
            calls.clear()
            torch.export.export = counting
            try:
                t0 = time.process_time()
                fxamp.amp_rewrite(model, (x,),
                                  fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                           frontend=frontend))
                rew.append(time.process_time() - t0)
            finally:
                torch.export.export = real
        p, r = statistics.median(plain), statistics.median(rew)
        rows.append([f"{name} ({size}x{size})", nodes, f"{p:.2f}", f"{r:.2f}", f"{r / p:.1f}",
                     len(calls)])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also 30k nodes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default="1000,3000,10000",
                    help="synthetic graph sizes in nodes (comma-separated)")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--export-models", default=EXPORT_MODELS,
                    help="timm models fx cannot trace, NAME:IMAGE_SIZE comma-separated "
                         "('' for none); default: %(default)s")
    ap.add_argument("--fx-models", default=FX_MODELS,
                    help="deep timm models fx takes, rewritten in train mode, NAME:IMAGE_SIZE "
                         "comma-separated ('' for none); default: %(default)s")
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    # process CPU time on one thread: the rewrite is single-threaded Python, and CPU time is
    # far less disturbed than wall time by other load on a small shared machine
    torch.set_num_threads(1)
    # warm-up: the first amp_rewrite in a process pays imports and caches
    fxamp.amp_rewrite(Chain(3), (torch.randn(2, 8),),
                      fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu"))
    dt = torch.bfloat16
    rows = []
    for name, (make, inputs) in ({} if a.skip_real else _common.models(2)).items():
        model = make().train()
        t_trace = timed(lambda: fx.symbolic_trace(model), a.repeat)
        n = len(fx.symbolic_trace(model).graph.nodes)
        off = fxamp.RewriteConfig.make(dtype=dt, target="cpu", policy="numerics=off")
        t_off = timed(lambda: fxamp.amp_rewrite(model, inputs, off), a.repeat)
        t_def = timed(lambda: fxamp.amp_rewrite(model, inputs,
                                                fxamp.RewriteConfig.make(dtype=dt, target="cpu")),
                      a.repeat)
        t_run = timed(lambda: model(*inputs), a.repeat)
        rows.append([name, n, f"{t_trace * 1e3:.0f}", f"{t_off * 1e3:.0f}",
                     f"{t_def * 1e3:.0f}", f"{t_def / t_trace:.1f}",
                     f"{t_def / n * 1e6:.0f}", f"{t_run * 1e3:.0f}"])
        print(rows[-1], flush=True)
    erows = export_rows(a.export_models, a.repeat)
    heads = ["model (batch 2)", "exported nodes", "plain static export s", "amp_rewrite s",
             "rewrite/export", "torch.export calls per rewrite"]
    md_export = _common.table(heads, erows)
    print(md_export)
    frows = export_rows(a.fx_models, a.repeat, frontend="auto", train=True)
    md_fx = _common.table(heads, frows)
    print(md_fx)
    md_real = _common.table(["model", "fx nodes", "symbolic_trace ms", "amp_rewrite "
                             "numerics=off ms", "amp_rewrite default ms", "default/trace",
                             "µs/node (default)", "one FP32 forward ms (for scale)"], rows)
    print(md_real)
    srows = []
    x = torch.randn(2, 8)
    sizes = ([] if a.skip_synthetic else [int(s) for s in a.sizes.split(",")]
             + ([30_000] if a.big else []))
    per_block = None
    for target_nodes in sizes:
        if per_block is None:
            per_block = (len(fx.symbolic_trace(Chain(10)).graph.nodes) - 2) / 10
        blocks = max(1, int(target_nodes / per_block))
        model = Chain(blocks)
        rep = a.repeat if target_nodes <= 10_000 else 1
        t_trace = timed(lambda: fx.symbolic_trace(model), rep)
        n = len(fx.symbolic_trace(model).graph.nodes)
        off = fxamp.RewriteConfig.make(dtype=dt, target="cpu", policy="numerics=off")
        t_off = timed(lambda: fxamp.amp_rewrite(model, (x,), off), rep)
        t_def = timed(lambda: fxamp.amp_rewrite(
            model, (x,), fxamp.RewriteConfig.make(dtype=dt, target="cpu")), rep)
        srows.append([n, f"{t_trace:.2f}", f"{t_off:.2f}", f"{t_def:.2f}",
                      f"{t_trace / n * 1e6:.0f}", f"{t_off / n * 1e6:.0f}",
                      f"{t_def / n * 1e6:.0f}", f"{t_def / t_trace:.1f}"])
        print(srows[-1], flush=True)
    md_syn = _common.table(["fx nodes", "symbolic_trace s", "amp_rewrite numerics=off s",
                            "amp_rewrite default s", "trace µs/node", "off µs/node",
                            "default µs/node", "default/trace"], srows)
    print(md_syn)
    if not a.no_docs:
        body = (f"Process CPU time (torch threads 1), medians of {a.repeat} runs "
                "(1 run at 30k nodes), bf16, target cpu. "
                "`amp_rewrite` includes its own trace, the shape/dtype propagation over the "
                "example inputs (FakeTensor propagation, node by node), the passes and "
                "recompile; 'one FP32 forward' is a real eager forward, for scale.\n\n"
                + ("Real models (batch 2, 64x64):\n\n" + md_real if rows else "")
                + ("\n\nModels only the export front end takes (timm, random weights, "
                   "eval mode; plain export and amp_rewrite interleaved):\n\n" + md_export
                   if erows else "")
                + ("\n\nDeep models torch.fx takes (timm, random weights, train mode: "
                   "both modes traced; amp_rewrite with the default front end against one "
                   "plain export, interleaved):\n\n" + md_fx if frows else "")
                + (f"\n\nSynthetic chains (Linear, relu, hand-written LayerNorm, residual; "
                   f"~{per_block:.0f} nodes per block, input 2x8):\n\n" + md_syn
                   if srows else ""))
        _common.append_docs("amp_rewrite time", body)


if __name__ == "__main__":
    main()
