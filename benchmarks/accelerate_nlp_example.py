"""accelerate's ``examples/nlp_example.py``, run as it is, with fxamp's one line against its own
``--mixed_precision bf16``, without downloads.

The example fine-tunes BERT on GLUE MRPC with ``padding="longest"`` (every batch its own
sequence length) for 3 epochs, evaluating after each. Its code is not copied here: pass the
file (from an accelerate checkout). What it downloads is replaced, outside its code:
``load_dataset`` gives generated MRPC-shaped data (sentence pairs of 3-30 words, 320 training
rows: 20 steps an epoch, 60 in all; 96 validation rows), ``AutoTokenizer`` a WordPiece
tokenizer over that vocabulary, ``AutoModelForSequenceClassification`` a tiny random BERT
(2 layers, hidden 64) and ``evaluate.load`` an accuracy that keeps the predictions. Runs, each
in its own process (the example seeds its own RNG):

- ``autocast``: ``mixed_precision="bf16"`` (accelerate's ``torch.autocast``);
- ``fxamp``: ``mixed_precision="no"`` and ``fxamp.amp_rewrite(model, config=..., inplace=True)``
  after the model is made (the collate pads to multiples of 8, as the example pads under
  mixed precision, so both runs see the same batches);
- ``fxamp+bf16``: the one line added to the ``bf16`` run.

It prints, per fxamp run, whether every loss (60 training steps, 9 evaluation batches) and
every evaluation line (accuracy and predictions) equals autocast's, and the graphs each block
planned (``fxamp.graphs_of``)::

    python benchmarks/accelerate_nlp_example.py PATH/TO/accelerate/examples/nlp_example.py

It needs ``accelerate`` and ``datasets`` (``pip install accelerate datasets``), and nothing
from the network.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

RUNS = ("autocast", "fxamp", "fxamp+bf16")
WORDS = [f"w{i}" for i in range(200)]


def _tokenizer(pad_to_8: bool) -> Any:
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    path = os.path.join(tempfile.mkdtemp(), "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab))
    tok = transformers.BertTokenizerFast(vocab_file=path, do_lower_case=False)
    if pad_to_8:
        pad = tok.pad

        def pad8(*args: Any, **kwargs: Any) -> Any:
            kwargs["pad_to_multiple_of"] = 8
            return pad(*args, **kwargs)
        tok.pad = pad8
    return tok


def _data() -> Any:
    import datasets

    rng = random.Random(0)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))

    def split(n: int) -> Any:
        return datasets.Dataset.from_dict({
            "sentence1": [sentence() for _ in range(n)],
            "sentence2": [sentence() for _ in range(n)],
            "label": [rng.randint(0, 1) for _ in range(n)], "idx": list(range(n))})

    return datasets.DatasetDict({"train": split(320), "validation": split(96)})


class _Accuracy:
    """``evaluate.load("glue", "mrpc")``'s calls, computing accuracy and keeping the
    predictions (what the runs are compared by)."""

    def __init__(self) -> None:
        self.predictions: List[int] = []
        self.references: List[int] = []

    def add_batch(self, predictions: Any, references: Any) -> None:
        self.predictions += predictions.tolist()
        self.references += references.tolist()

    def compute(self) -> Dict[str, Any]:
        right = sum(int(p == r) for p, r in zip(self.predictions, self.references))
        return {"accuracy": right / len(self.predictions), "predictions": self.predictions}


def worker(example: str, run: str) -> Dict[str, Any]:
    """One run in this process: the example's ``training_function`` with its downloads
    replaced; the losses of every forward with labels, the printed evaluations and the
    graphs fxamp planned."""
    import torch
    import transformers

    import fxamp

    spec = importlib.util.spec_from_file_location("nlp_example", example)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)  # type: ignore[union-attr]
    data, tok = _data(), _tokenizer(pad_to_8=run == "fxamp")
    ex.load_dataset = lambda *a, **k: data
    ex.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: tok)
    ex.evaluate = types.SimpleNamespace(load=lambda *a, **k: _Accuracy())
    losses: List[float] = []
    made: List[Any] = []

    def model(*args: Any, **kwargs: Any) -> Any:
        torch.manual_seed(7)
        cfg = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=128)
        net = transformers.BertForSequenceClassification(cfg)
        if run != "autocast":  # the one line
            fxamp.amp_rewrite(net, config=fxamp.RewriteConfig.make(
                dtype=torch.bfloat16, target="cpu"), inplace=True)
        net.register_forward_hook(lambda m, i, out: losses.append(out.loss.item())
                                  if getattr(out, "loss", None) is not None else None)
        made.append(net)
        return net

    ex.AutoModelForSequenceClassification = types.SimpleNamespace(from_pretrained=model)
    printed: List[str] = []
    ex.Accelerator.print = lambda self, *a, **k: printed.append(" ".join(map(str, a)))
    args = types.SimpleNamespace(cpu=True, mixed_precision="no" if run == "fxamp" else "bf16")
    ex.training_function({"lr": 2e-5, "num_epochs": 3, "seed": 42, "batch_size": 16}, args)
    graphs = fxamp.graphs_of(made[0]) if run != "autocast" else {}
    return {"losses": losses, "printed": printed, "graphs": graphs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("example", help="accelerate's examples/nlp_example.py")
    ap.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.example, a.worker)))
        return
    results = {}
    for run in RUNS:
        proc = subprocess.run([sys.executable, __file__, a.example, "--worker", run],
                              capture_output=True, text=True, check=True)
        results[run] = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = results["autocast"]
    rows = []
    for run in RUNS[1:]:
        got = results[run]
        same = sum(x == y for x, y in zip(got["losses"], ref["losses"]))
        most = max((len(v) for v in got["graphs"].values()), default=0)
        rows.append([run, f"{same} of {len(ref['losses'])}",
                     "yes" if got["printed"] == ref["printed"] else "no",
                     f"{len(got['graphs'])} modules, at most {most} each"])
    print(table(["run", "losses equal to autocast's", "evaluations equal", "graphs planned"],
                rows))


if __name__ == "__main__":
    main()
