"""A rank of a torch.distributed "p2pcoll" world for tests/test_flight_processes.py: a few
ops of the backend (collectives, a send and a receive, all_to_all_single), then it prints
its flight record as JSON, ``{"record": [[collective, state, shapes], ...]}``."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import p2pcoll.torch  # noqa: F401  (registers the backend)
from p2pcoll.integrations.torch.hooks import p2pcoll_group


def main() -> None:
    dist.init_process_group("p2pcoll")
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(2, 4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    if rank == 0:
        dist.send(t, dst=1)
    elif rank == 1:
        dist.recv(t, src=0)
    out = torch.empty(2 * size)
    dist.all_to_all_single(out, torch.arange(2 * size, dtype=torch.float32))
    dist.barrier()
    record = p2pcoll_group(None).flight_record()
    print(json.dumps({"record": [[e["collective"], e["state"], e["shapes"]]
                                  for e in record]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
