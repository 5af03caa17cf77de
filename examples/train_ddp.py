"""Train an MLP on scikit-learn's digits with DistributedDataParallel, on Gloo or p2pcoll.

    torchrun --nproc-per-node 4 examples/train_ddp.py --backend p2pcoll
    p2pcoll launch -n 4 -- python examples/train_ddp.py --backend p2pcoll
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo

The only p2pcoll-specific thing is the backend's name: installing p2pcoll registers it
with torch. Every rank trains on its own shard of each batch with the same seed; with
``--save PATH`` rank 0 writes the final parameters there (to compare two runs), and every
run checks that all ranks end with bit-identical parameters.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "p2pcoll"], default="p2pcoll")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--save", help="where rank 0 writes the final parameters")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    per_rank = args.batch // size
    for epoch in range(args.epochs):
        total = 0.0
        for start in range(0, len(x) - args.batch + 1, args.batch):
            batch = order[start + rank * per_rank:start + (rank + 1) * per_rank]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            mean = total / (len(x) // args.batch)
            print(f"epoch {epoch}: mean loss of rank 0's shards {mean:.4f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    identical = all(torch.equal(everyone[0], other) for other in everyone)
    if rank == 0:
        print(f"{args.backend}: parameters identical on all {size} ranks: {identical}",
              flush=True)
        if args.save:
            torch.save(flat, args.save)
    dist.destroy_process_group()
    del model, opt  # released before exit (see the p2pcoll torch backend's notes)
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
