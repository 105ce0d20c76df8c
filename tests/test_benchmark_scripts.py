"""The step-time benchmarks run end to end on the CPU (tiny sizes): benchmarks/gpu.py's
``--device cpu --smoke`` mode and cpu_step_time.py's variants, without writing docs."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # runs the benchmark scripts in subprocesses


def _cpu_line() -> str:
    """The start of the line every benchmark table is printed with (this CPU's bf16 support)."""
    import torch
    return f"CPU bf16: torch capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "


def _run(*args: str, timeout: int = 600) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_gpu_script_smoke_on_cpu_prints_rows_as_it_goes():
    out = _run("benchmarks/gpu.py", "--device", "cpu", "--smoke", "--dtypes", "bf16",
               "--no-docs")
    lines = out.splitlines()
    rows = [line for line in lines if line.startswith("ROW ")]
    assert len(rows) == 2, out
    # a line per variant is printed before the model's row, channels_last and limit included
    first_row = lines.index(rows[0])
    measured = " ".join(lines[:first_row])
    for variant in ("autocast:", "fxamp:", "limit:", "autocast NHWC:", "fxamp channels_last:"):
        assert variant in measured, out
    cnn = eval(rows[0][4:])  # noqa: S307 - the list the script printed
    assert float(cnn[9]) > 0  # fxamp channels_last vs autocast NHWC
    assert float(cnn[6]) > 0 and float(cnn[7]) > 0  # vs autocast, vs limit
    assert "| fxamp channels_last vs autocast NHWC |" in out
    assert _cpu_line() in out.split("| model |")[0], out  # above the table


def test_cpu_step_time_infer_runs_every_variant():
    out = _run("benchmarks/cpu_step_time.py", "--mode", "infer", "--models", "gpt_tiny",
               "--batch", "1", "--rounds", "1", "--steps", "1", "--seq", "8", "--no-docs")
    row = next(line for line in out.splitlines() if line.startswith("['gpt_tiny'"))
    cells = eval(row)  # noqa: S307
    assert "FAILED" not in cells and "NOTE" not in out
    cpu = next(line for line in out.splitlines() if line.startswith("CPU bf16: "))
    assert cpu.startswith(_cpu_line()) and "avx512_bf16 " in cpu and "amx_bf16 " in cpu, cpu
    assert out.index(cpu) < out.index("| model")  # the table's header line follows it
    counts = dict(zip(["fp32", "autocast", "autocast nocache", "limit", "fxamp", "fxamp cast",
                       "fxamp o2"], cells[-2].split()))
    assert len(cells[-1].split()) == 7  # page faults per variant
    # launches: the limit casts nothing; fxamp's default casts every weight per forward, as
    # autocast without its cache does; o2's kept copies cast fewer
    assert counts["limit"].endswith("/0")
    casts = {k: int(v.split("/")[1]) for k, v in counts.items()}
    # (+1: fxamp casts the logits back to FP32, output_dtype's default; autocast leaves bf16)
    assert casts["fxamp"] == casts["fxamp cast"] <= casts["autocast nocache"] + 1
    assert casts["fxamp o2"] < casts["fxamp"]


def test_step_profile_splits_a_training_step_by_phase():
    out = _run("benchmarks/step_profile.py", "--models", "gpt_tiny", "--seq", "8", "--steps",
               "1", "--timed", "1", "--variants", "limit,fxamp", "--top", "3")
    assert "## limit:" in out and "## fxamp:" in out, out
    assert _cpu_line() in out.split("## limit:")[0], out  # in the header line, above the tables
    for phase in ("| forward |", "| backward |", "| optimizer |"):
        assert out.count(phase) == 2, out
    assert "aten::" in out  # the top ops


def test_cpu_step_time_train_gives_the_fp32_master_bound():
    out = _run("benchmarks/cpu_step_time.py", "--mode", "train", "--models", "gpt_tiny",
               "--batch", "1", "--rounds", "1", "--steps", "1", "--seq", "8", "--no-docs")
    assert "| FP32-master bound ms | bound/ac / fxamp/bound |" in out, out
    row = eval(next(line for line in out.splitlines() if line.startswith("['gpt_tiny'")))
    limit_ms, bound_ms = float(row[3 + 3]), float(row[-4])
    # (both measured: their sizes are the benchmark's to show, not a timed assertion's: the
    # bound is a difference of timings, which one round of one step on a loaded machine can
    # make even negative)
    assert math.isfinite(limit_ms) and math.isfinite(bound_ms), row
    bound_ratio, fxamp_ratio = (float(v) for v in row[-3].split(" / "))
    assert bound_ratio > 0 and fxamp_ratio > 0, row


def test_export_peers_runs_fxamp_and_skips_peers_that_are_not_installed():
    out = _run("benchmarks/export_peers.py", "--models", "trap", "--no-docs", "--rounds", "1",
               "--peer-python", sys.executable)  # this env has neither peer
    assert "trap: ModelOpt AutoCast skipped: not installed" in out
    assert "trap: onnxconverter-common skipped: not installed" in out
    assert "| trap | fxamp tensorrt | yes | yes |" in out
    assert "| trap | - (no peer ran) |" in out  # no peer ran: nothing compared


def test_export_peers_reports_the_mean_and_max_error_over_8_batches():
    import re

    out = _run("benchmarks/export_peers.py", "--models", "trap", "--no-docs", "--rounds", "1")
    assert "| error, onnxruntime CPU: mean (max) of 8 batches | error, true FP16: mean (max) " \
           "of 8 batches |" in out
    assert "| mean true-FP16 error <= 1.1x best correct peer |" in out
    row = next(line for line in out.splitlines() if line.startswith("| trap | fxamp tensorrt"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    for cell in cells[4:6]:  # onnxruntime, true FP16: "mean (max)"
        mean, worst = (float(v) for v in re.fullmatch(r"(\S+) \((\S+)\)", cell).groups())
        assert 0 < mean <= worst, row


def test_runtime_overhead_prints_every_variant_and_fxamp_holds_nothing_between_steps():
    out = _run("benchmarks/runtime_overhead.py", "--layers", "1", "--d", "32", "--vocab", "64",
               "--seq", "8", "--rounds", "1", "--steps", "1")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| variant")}
    assert set(rows) == {"fp32", "autocast", "fxamp", "fxamp inplace", "fxamp blocks",
                         "fxamp guard=on"}, out
    for name in ("fxamp", "fxamp inplace", "fxamp blocks"):
        assert rows[name][-1] == "0.00", out  # extra bytes held per parameter
        assert float(rows[name][-2]) <= 1.3, out  # Python calls per forward / fp32's


def test_zoo_sweep_classes_two_tiny_models_identical_to_autocast():
    """zoo.py runs a training step and an eval forward per model against autocast and prints
    one row per model with its class, then the counts per class and per family."""
    out = _run("benchmarks/zoo.py", "--limit", "2", "--only",
               r"^(timm/test_resnet|huggingface/bert)$", "--timeout", "300")
    models_table = out.split("\n\n")[0]  # the counts follow, after a blank line
    rows = {cells[1]: cells for cells in
            ([c.strip() for c in line.split("|")[1:-1]] for line in models_table.splitlines()
             if line.startswith("| ") and not line.startswith("| family"))}
    assert set(rows) == {"test_resnet", "bert"}, out
    for name, cells in rows.items():
        # class; the training step's outputs/loss and gradients, the eval forward: all equal
        assert cells[3] == "identical" and cells[4:7] == ["0", "0", "0"], out
    assert "- identical: 2 (of 2)" in out, out
    assert "| timm | 1 | 1 |" in out and "| huggingface | 1 | 1 |" in out, out


def test_zoo_cast_cache_class_names_exactly_the_modules_called_twice():
    """The zoo's "cast cache" class: a module rewritten on its own and called twice per step
    (as blocks and eager children are) gives gradients that differ from autocast's on its
    Parameters alone (autocast sums both calls' gradients in bf16 through its one cached
    cast), and the zoo's count of calls per module names exactly those Parameters."""
    import copy

    import torch
    import torch.nn as nn

    import fxamp
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import zoo
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shared = self.blocks[0]
            return self.head(shared(torch.relu(self.blocks[1](shared(x)))))

    torch.manual_seed(0)
    model, x = Twice(), (torch.randn(8, 16),)
    ref, amp = copy.deepcopy(model), copy.deepcopy(model)
    ref_out, ref_loss = zoo._step(ref, x, {}, autocast=True)
    for part in (amp.blocks[0], amp.blocks[1], amp.head):  # (the root's relu: any dtype)
        fxamp.amp_rewrite(part, config="cpu-bf16", inplace=True)
    out, loss = zoo._step(amp, x, {}, autocast=False)
    assert torch.equal(out.float(), ref_out.float()) and torch.equal(loss, ref_loss)
    differ = {n for n, a, b in zip(*zoo._grads(ref), zoo._grads(amp)[1])
              if not torch.equal(a, b)}
    assert differ and differ <= {"blocks.0.weight", "blocks.0.bias"}, differ
    assert zoo._called_again(copy.deepcopy(model), x, {}) == {"blocks.0.weight", "blocks.0.bias"}


def _peer_goals():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import export_peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return export_peers


def _result(fp16: float, total: float = 1.0, mean_abs: float = 1e-4) -> dict:
    return {"ok": True, "fp16": fp16, "fp16_rel": 0.001, "fp16_abs": mean_abs, "casts": 2,
            "share": "4/4", "bn": 0, "total": total}


def test_export_peers_judges_a_missed_max_on_the_mean_absolute_error():
    """A mean of per-batch maxima over 1.1x the best peer's passes only where the mean
    absolute error over every output is within 1.1x (one element's max swings 3x on a
    batch between files that differ in a few weights' last bit); a worse file fails."""
    peers = _peer_goals()
    noisy = peers._goals("m", {"fxamp": _result(9.1e-4, mean_abs=3.959e-4),
                               "occ": _result(7.9e-4, mean_abs=3.963e-4)}, 1.0)
    assert noisy[1] == "yes (0.00091 vs 0.00079; mean abs error 0.0004 vs 0.0004)", noisy
    worse = peers._goals("m", {"fxamp": _result(9.1e-4, mean_abs=5e-4),
                               "occ": _result(7.9e-4, mean_abs=4e-4)}, 1.0)
    assert worse[1] == "no (0.00091 vs 0.00079)", worse


def test_export_peers_judges_rewrite_and_export_against_the_fp32_export():
    peers = _peer_goals()
    ok = peers._goals("m", {"fxamp": _result(1e-3, total=1.29), "occ": _result(1e-3)}, 1.0)
    slow = peers._goals("m", {"fxamp": _result(1e-3, total=1.31), "occ": _result(1e-3)}, 1.0)
    assert ok[-1] == "yes (1.29 vs 1.00 s, 1.29x)" and slow[-1].startswith("no"), (ok, slow)
