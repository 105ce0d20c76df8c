"""Train a small MLP on scikit-learn's 8x8 digits with fxamp.amp_rewrite + fxamp.train.

    python examples/train_digits.py [--epochs 6] [--dtype fp16|bf16] [--inject-overflow]

FP16 on CPU (target="cpu") is slow but exact enough for this model; the GradScaler is
created by the Trainer. ``--inject-overflow`` feeds one batch with a huge value to show a
skipped step and the node that overflowed (``heal=True`` then moves it to FP32 after two).
"""
import argparse
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import fxamp


class MLP(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.head(h)


def digits(seed: int = 0):
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = 360
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--inject-overflow", action="store_true")
    args = parser.parse_args()
    logging.getLogger("fxamp.train").setLevel(logging.ERROR)  # printed below instead

    torch.manual_seed(0)
    (x_train, y_train), (x_test, y_test) = digits()
    model = MLP()
    example = (x_train[:2],)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    gm = fxamp.amp_rewrite(model, example, fxamp.RewriteConfig.make(dtype=dtype, target="cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = args.epochs * ((len(x_train) + args.batch - 1) // args.batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    trainer = fxamp.train.Trainer(gm, optimizer, clip_grad_norm=5.0, scheduler=scheduler,
                                  heal=True, original_model=model, example_inputs=example)
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_train))
        losses = []
        for i in range(0, len(x_train), args.batch):
            idx = perm[i:i + args.batch]
            x, y = x_train[idx], y_train[idx]
            if args.inject_overflow and epoch == 0 and i // args.batch in (3, 5):
                x = x.clone()
                x[0] = 6e4  # out of fp16 range after the first linear layer
            result = trainer.step(loss_fn, x, y)
            if result.skipped:
                print(f"skipped step {result.step}: {result.overflow}")
            if result.healed:
                print(f"healed: node {result.healed!r} now computes in fp32")
            if not result.skipped:
                losses.append(result.loss)
        acc = accuracy(trainer.gm, x_test, y_test)
        print(f"epoch {epoch}: loss {sum(losses) / len(losses):.4f} test accuracy {acc:.4f}")
    print(trainer.summary())
    print(f"test accuracy: {accuracy(trainer.gm, x_test, y_test):.4f}")


if __name__ == "__main__":
    main()
