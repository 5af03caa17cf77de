"""The digits example with a PyTorch model: gradients taken from ``.grad``, reduced as they appear.

    pip install -e '.[examples,torch]'
    p2pcoll launch -n 4 -- python examples/train_torch.py

The same data split and schedule as ``train_digits.py``, with ``torch.nn`` and
``torch.optim.SGD`` on the CPU. Tensors are handed to p2pcoll as they are:
``tensor.numpy()`` shares their memory, so nothing is copied to get in or out of numpy.

The gradients go through a :class:`p2pcoll.training.GradientReducer`: a hook on each
parameter copies its ``.grad`` into its bucket the moment autograd has accumulated it, and
a full bucket is queued for its allreduce at once (backward runs the last layer first, which
is the reducer's default bucket order). ``loss.backward()`` itself does not yield to the
event loop, so here the transfers begin at the ``await`` right after it; a model whose
backward pass awaits between layers gets the overlap. The reduced gradients are written back
into ``.grad`` and the optimizer steps as usual. At the end each rank trains the same model
alone on the whole of every batch and checks that the weights agree to 1e-6 relative.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import p2pcoll
from p2pcoll import training

RTOL = 1e-6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-bytes", type=int, default=None)
    return parser.parse_args()


def make_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10)
    ).double()


def batches(n: int, batch: int, epoch: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i:i + batch] for i in range(0, n, batch)]


def loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum")


def train_alone(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    """The reference: one process, rank 0's initial weights, every whole global batch."""
    model = make_model(args.hidden, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        for idx in batches(len(y), args.batch, epoch, args.seed):
            opt.zero_grad()
            (loss_sum(model, x[idx], y[idx]) / len(idx)).backward()
            opt.step()
    return model


async def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # the peers share the machine's cores
    digits = load_digits()
    x_np, xt_np, y_np, yt_np = train_test_split(digits.data / 16.0, digits.target,
                                                test_size=0.2, random_state=args.seed,
                                                stratify=digits.target)
    x, x_test = torch.from_numpy(x_np), torch.from_numpy(xt_np)
    y, y_test = torch.from_numpy(y_np), torch.from_numpy(yt_np)

    async with p2pcoll.join() as g:
        rank, size, lead = g.rank, g.world_size, g.rank == 0
        model = make_model(args.hidden, args.seed + rank)  # deliberately different
        params = dict(model.named_parameters())
        await training.broadcast_parameters(g, params, root=0)  # written into the tensors
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        reducer = training.GradientReducer(g, params, op="sum", bucket_bytes=args.bucket_bytes,
                                           check_every=50)

        # Each parameter's hook hands its gradient to the round that is open.
        current: dict[str, training.Round] = {}
        for name, param in params.items():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: current["round"].add(name, p.grad))

        epochs = [batches(len(y), args.batch, e, args.seed) for e in range(args.epochs)]
        bar: Any = tqdm(total=sum(map(len, epochs)), disable=not lead, unit="round",
                        file=sys.stdout, mininterval=0.5, ncols=100)
        started = time.perf_counter()
        for epoch_batches in epochs:
            for idx in epoch_batches:
                mine = idx[rank::size]  # this rank's share of the global batch
                opt.zero_grad()
                async with reducer.start_round() as rnd:
                    current["round"] = rnd
                    loss = loss_sum(model, x[mine], y[mine]) / len(idx)
                    loss.backward()  # the hooks fill the buckets, last layer first
                    grads = await rnd.wait()
                for name, param in params.items():
                    assert param.grad is not None
                    param.grad.copy_(grads[name])
                opt.step()
                bar.set_postfix(loss=f"{loss.item() * size:.3f}", refresh=False)  # ~ mean
                bar.update()
        bar.close()
        elapsed = time.perf_counter() - started

        await reducer.check_replicas()
        with torch.no_grad():
            test_acc = (model(x_test).argmax(dim=1) == y_test).double().mean().item()
        alone = dict(train_alone(args, x, y).named_parameters())
        diff = max(((params[k] - alone[k]).abs().max() / alone[k].abs().max()).item()
                   for k in params)
        same = diff <= RTOL
        if lead:
            print(f"trained {args.epochs} epochs, {bar.total} rounds in {elapsed:.2f}s")
            print(f"test accuracy: {test_acc:.2%}")
            print(f"replicas identical on all {size} ranks (check_replicas)")
        verdict = "equal" if same else "DIFFER FROM"
        print(f"rank {rank}: final weights {verdict} single-process training "
              f"(max relative difference {diff:.1e}, tolerance {RTOL:g})")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
