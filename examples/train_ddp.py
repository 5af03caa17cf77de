"""Train an MLP on scikit-learn's digits with DistributedDataParallel (or FSDP2), on Gloo
or p2pcoll.

    torchrun --nproc-per-node 4 examples/train_ddp.py --backend p2pcoll
    p2pcoll launch -n 4 -- python examples/train_ddp.py --backend p2pcoll
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend p2pcoll --fsdp
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend p2pcoll --hook powersgd

The only p2pcoll-specific thing is the backend's name: installing p2pcoll registers it
with torch. Every rank trains on its own shard of each batch with the same seed; with
``--save PATH`` rank 0 writes the final parameters there (to compare two runs), and every
run checks that all ranks end with bit-identical parameters.

``--fsdp`` shards the model with FSDP2 (``fully_shard``: all_gather_into_tensor of the
parameters, reduce_scatter_tensor of the gradients with AVG) instead of DDP; ``--hook``
registers one of torch's DDP communication hooks: ``fp16`` (gradients allreduced in
float16) or ``powersgd`` (rank-1 PowerSGD compression from the third step on).

With more than two ranks the order in which the ranks' terms are added decides the last
bits of every sum, and training amplifies any difference. The p2pcoll backend adds them in
Gloo's order by default (the ``gloo_ring`` strategy; its float16 and bfloat16 sums round
after every add as Gloo's do), so at any world size its final parameters are Gloo's bit for
bit, with or without the hooks and FSDP2. ``P2PCOLL_ALLREDUCE=auto`` trades that for
p2pcoll's fastest strategy (still identical on all ranks, no longer Gloo's bits).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def wrap(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """The model under FSDP2 or DDP (with the communication hook asked for)."""
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    ddp = DistributedDataParallel(model)
    if args.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (FSDP2's parameters are sharded DTensors)."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["gloo", "p2pcoll"], default="p2pcoll")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--hook", choices=["fp16", "powersgd"],
                        help="a DDP communication hook")
    parser.add_argument("--save", help="where rank 0 writes the final parameters")
    args = parser.parse_args()
    if args.fsdp and args.hook:
        parser.error("--hook is for DDP, not --fsdp")

    from sklearn.datasets import load_digits  # here: tests import wrap() without scikit-learn

    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = wrap(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)), args)
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

    flat = torch.cat([full(p).reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    identical = all(torch.equal(everyone[0], other) for other in everyone)
    if rank == 0:
        print(f"{args.backend}: parameters identical on all {size} ranks: {identical}",
              flush=True)
        if args.save:
            torch.save(flat, args.save)
    dist.destroy_process_group()
    # Released before exit, cycles included (FSDP2's hooks hold the modules): a process group
    # whose last references die in the interpreter's own teardown can abort the process
    # ("terminate called without an active exception"), with Gloo as with p2pcoll.
    del model, opt, everyone
    gc.collect()
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
