"""Rewrite time of torchvision ResNet-50 and ViT-B/16 and how often annotate runs.

Random weights, batch 1, 224x224; targets fp16/cuda (planned on the CPU: no GPU needed) and
bf16/cpu. For each: the median wall time of ``amp_rewrite`` over ``--repeat`` runs, the
number of annotate runs over the graph (``_Simulator.run``) per rewrite and the number of
node executions on fake tensors (``_Simulator._run``) per rewrite: since one FakeSession
serves the whole rewrite, a later annotate run re-executes only the nodes whose decision or
inputs changed. One warm-up rewrite per configuration first (autocast observation cache).

    python benchmarks/annotate_runs.py [--repeat 3] [--only resnet50] [--write]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_docs, table  # noqa: E402


def _counting():
    """Patch the annotate simulator to count fake runs and node executions."""
    from fxamp.passes import annotate
    counts = {"runs": 0, "nodes": 0}
    sim = annotate._Simulator
    run, run_node = sim.run, sim._run

    def counted_run(self, *a, **k):
        counts["runs"] += 1
        return run(self, *a, **k)

    def counted_node(self, *a, **k):
        counts["nodes"] += 1
        return run_node(self, *a, **k)
    sim.run, sim._run = counted_run, counted_node
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="", help="substring of the model name")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--label", default="", help="label of this run (e.g. before / after)")
    args = ap.parse_args()
    import torchvision
    import fxamp
    counts = _counting()
    torch.manual_seed(0)
    models = {"resnet50": torchvision.models.resnet50, "vit_b_16": torchvision.models.vit_b_16}
    configs = [(torch.float16, "cuda"), (torch.bfloat16, "cpu")]
    rows = []
    for name, make in models.items():
        if args.only not in name:
            continue
        model = make(weights=None).eval()
        x = torch.randn(1, 3, 224, 224)
        for dtype, target in configs:
            times, cpu, runs, nodes = [], [], [], []
            # warm-up (caches)
            fxamp.amp_rewrite(model, (x,), fxamp.RewriteConfig.make(dtype=dtype, target=target))
            for _ in range(args.repeat):
                counts.update(runs=0, nodes=0)
                start, start_cpu = time.perf_counter(), time.process_time()
                gm = fxamp.amp_rewrite(model, (x,),
                                       fxamp.RewriteConfig.make(dtype=dtype, target=target))
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
                runs.append(counts["runs"])
                nodes.append(counts["nodes"])
            n = len(gm.graph.nodes)
            rows.append([name, f"{str(dtype).split('.')[-1]}/{target}", str(n),
                         f"{statistics.median(times):.2f}", f"{min(times):.2f}",
                         f"{statistics.median(cpu):.2f}",
                         str(runs[-1]), str(nodes[-1])])
            print(" | ".join(rows[-1]), flush=True)
    text = table(["model", "dtype/target", "nodes", "median s", "min s", "median CPU s",
                  "annotate runs", "node executions"], rows)
    print(text)
    if args.write:
        append_docs(f"Rewrite time and annotate runs {args.label}".strip(), text,
                    "Shared, busy machine (load average above 10 on 2 cores): wall times are "
                    "noisy; CPU time is the steadier figure.")


if __name__ == "__main__":
    main()
