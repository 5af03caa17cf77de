"""Data-parallel training of a small numpy MLP on scikit-learn's digits, one shard per peer.

    pip install -e '.[examples]'
    p2pcoll launch -n 4 -- python examples/train_digits.py
    python examples/train_digits.py                 # alone: a group of one

The 8x8 digit images ship with scikit-learn (``load_digits``; nothing is downloaded). Each
step takes the next global batch of a shuffled epoch; rank r computes the gradient of the
cross-entropy over its own share of that batch (every p-th sample); the ranks sum their
shares with ``p2pcoll.training.allreduce_gradients`` and every rank applies the same SGD
step, so the replicas never differ. There is no parameter server.

Each rank starts from weights of its own (seeded by its rank); ``broadcast_parameters``
gives everyone rank 0's. At the end every rank also trains the same model alone on the whole
of every batch and checks that the two results agree to 1e-6 relative: averaging gradients is
exact, so p peers train exactly the model one process would. Rank 0 shows a progress bar
with the loss and accuracy, prints the test accuracy and writes the loss curve to a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import p2pcoll
from p2pcoll import training

Params = dict[str, np.ndarray]
RTOL = 1e-6


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", default=None, help="allreduce strategy (default: auto)")
    parser.add_argument("--check-every", type=int, default=50, metavar="ROUNDS",
                        help="compare the replicas' weights every this many rounds")
    parser.add_argument("--plot", default="train_digits_loss.png", help="loss curve PNG")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    return parser.parse_args(argv)


# --- the model: 64 -> hidden (tanh) -> 10 (softmax), in float64 ----------------------------


def init_params(hidden: int, seed: int) -> Params:
    rng = np.random.default_rng(seed)
    return {
        "hidden.weight": rng.normal(0, 64 ** -0.5, (64, hidden)),
        "hidden.bias": np.zeros(hidden),
        "out.weight": rng.normal(0, hidden ** -0.5, (hidden, 10)),
        "out.bias": np.zeros(10),
    }


def forward(p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.tanh(x @ p["hidden.weight"] + p["hidden.bias"])
    logits = h @ p["out.weight"] + p["out.bias"]
    prob = np.exp(logits - logits.max(axis=1, keepdims=True))
    return h, prob / prob.sum(axis=1, keepdims=True)


def gradients(p: Params, x: np.ndarray, y: np.ndarray, batch: int) -> dict[str, np.ndarray]:
    """Gradients of the cross-entropy summed over (x, y) and divided by the global ``batch``,
    plus the same sums of the loss and the hits in ``"stats"``: summed over the ranks'
    shares, each is the mean over the whole global batch."""
    h, prob = forward(p, x)
    rows = np.arange(len(y))
    loss = -np.log(prob[rows, y]).sum()
    hits = float((prob.argmax(axis=1) == y).sum())
    d_logits = prob.copy()
    d_logits[rows, y] -= 1
    d_logits /= batch
    d_h = (d_logits @ p["out.weight"].T) * (1 - h * h)
    return {
        "hidden.weight": x.T @ d_h,
        "hidden.bias": d_h.sum(axis=0),
        "out.weight": h.T @ d_logits,
        "out.bias": d_logits.sum(axis=0),
        "stats": np.array([loss, hits]) / batch,
    }


def sgd_step(p: Params, grads: dict[str, np.ndarray], lr: float) -> None:
    for name, param in p.items():
        param -= lr * grads[name]  # in place: the replicas keep their arrays


def accuracy(p: Params, x: np.ndarray, y: np.ndarray) -> float:
    return float((forward(p, x)[1].argmax(axis=1) == y).mean())


def batches(n: int, batch: int, epoch: int, seed: int) -> list[np.ndarray]:
    """The global batches of one epoch: the same on every rank (seeded by epoch)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i:i + batch] for i in range(0, n, batch)]


def train_alone(args: argparse.Namespace, x: np.ndarray, y: np.ndarray) -> Params:
    """The reference: one process, rank 0's initial weights, every whole global batch."""
    p = init_params(args.hidden, args.seed)
    for epoch in range(args.epochs):
        for idx in batches(len(y), args.batch, epoch, args.seed):
            sgd_step(p, gradients(p, x[idx], y[idx], len(idx)), args.lr)
    return p


def max_relative_difference(a: Params, b: Params) -> float:
    """Per tensor, the largest difference relative to the tensor's largest value."""
    return max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k]))) for k in a)


def plot(path: str, losses: list[float], steps_per_epoch: int, world_size: int,
         test_acc: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rounds = np.arange(1, len(losses) + 1)
    ax.plot(rounds, losses, lw=0.8, alpha=0.6, label="per round (global batch)")
    per_epoch = np.add.reduceat(losses, np.arange(0, len(losses), steps_per_epoch))
    counts = np.diff(np.append(np.arange(0, len(losses), steps_per_epoch), len(losses)))
    ax.plot(np.minimum(np.arange(1, len(counts) + 1) * steps_per_epoch, len(losses)),
            per_epoch / counts, "o-", lw=1.5, ms=3, label="epoch mean")
    ax.legend()
    ax.set_xlabel(f"round (global batch; {steps_per_epoch} per epoch)")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_yscale("log")
    ax.set_title(f"digits MLP, {world_size} peers, test accuracy {test_acc:.1%}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``x, x_test, y, y_test``: the digits, scaled to [0, 1], 80/20 (the same on every rank)."""
    digits = load_digits()
    x, x_test, y, y_test = train_test_split(digits.data / 16.0, digits.target, test_size=0.2,
                                            random_state=seed, stratify=digits.target)
    return x, x_test, y, y_test


# on_round(epoch, loss, hits): after each round, with the global batch's mean loss and accuracy.
OnRound = Callable[[int, float, float], None]


async def train(g: p2pcoll.Group, args: argparse.Namespace, x: np.ndarray, y: np.ndarray,
                on_round: OnRound | None = None) -> tuple[Params, list[float]]:
    """Train data-parallel in group ``g``: the final weights (the same on every rank, checked)
    and the loss of each round."""
    rank, size = g.rank, g.world_size
    params = init_params(args.hidden, args.seed + rank)  # deliberately different
    params = await training.broadcast_parameters(g, params, root=0)
    await training.check_replicas(g, params)
    losses: list[float] = []
    for epoch in range(args.epochs):
        for idx in batches(len(y), args.batch, epoch, args.seed):
            mine = idx[rank::size]  # this rank's share of the global batch
            grads = gradients(params, x[mine], y[mine], len(idx))
            grads = await training.allreduce_gradients(g, grads, op="sum",
                                                       strategy=args.strategy)
            loss, hits = grads.pop("stats")
            sgd_step(params, grads, args.lr)
            losses.append(float(loss))
            if args.check_every and len(losses) % args.check_every == 0:
                await training.check_replicas(g, params)
            if on_round is not None:
                on_round(epoch, float(loss), float(hits))
    await training.check_replicas(g, params)
    return params, losses


async def main(args: argparse.Namespace) -> int:
    x, x_test, y, y_test = load_data(args.seed)

    async with p2pcoll.join() as g:
        rank, size = g.rank, g.world_size
        lead = rank == 0
        if lead:
            print(f"{size} peers, {len(y)} training images ({len(y) // size} or so each per "
                  f"epoch), {len(y_test)} test images; every replica starts from rank 0's "
                  f"weights")

        steps_per_epoch = len(batches(len(y), args.batch, 0, args.seed))
        bar: Any = tqdm(total=args.epochs * steps_per_epoch, disable=not lead, unit="round",
                        file=sys.stdout, mininterval=0.5, ncols=100)

        def show(epoch: int, loss: float, hits: float) -> None:
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}", acc=f"{hits:.1%}",
                            refresh=False)
            bar.update()

        started = time.perf_counter()
        params, losses = await train(g, args, x, y, show)
        elapsed = time.perf_counter() - started
        bar.close()

        test_acc = accuracy(params, x_test, y_test)
        alone = train_alone(args, x, y)
        diff = max_relative_difference(params, alone)
        same = diff <= RTOL
        if lead:
            print(f"trained {args.epochs} epochs, {len(losses)} rounds in {elapsed:.2f}s; "
                  f"final loss {losses[-1]:.4f}")
            print(f"test accuracy: {test_acc:.2%}")
            print(f"replicas identical on all {size} ranks (check_replicas)")
            if not args.no_plot:
                plot(args.plot, losses, steps_per_epoch, size, test_acc)
                print(f"loss curve written to {args.plot}")
        verdict = "equal" if same else "DIFFER FROM"
        print(f"rank {rank}: final weights {verdict} single-process training "
              f"(max relative difference {diff:.1e}, tolerance {RTOL:g})")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
