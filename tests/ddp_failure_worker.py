"""One rank of tests/test_ddp_failure.py: trains until a peer is lost, then checkpoints.

    python tests/ddp_failure_worker.py MODE CHECKPOINT_DIR [--backend p2pcoll|gloo]

MODE is one of examples/train_ddp.py's: ``plain`` (DDP), ``fp16`` or ``powersgd`` (DDP with
that communication hook), ``fsdp`` (FSDP2); the model is wrapped by the example's own
``wrap``. The rank, world size and rendezvous come from the environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), as torchrun sets them.

Every rank prints ``STEP <n>`` after each step. The test kills one rank; each survivor
must catch the error torch's DDP/FSDP2 raise (``torch.distributed.DistBackendError``, or
the RuntimeError torch makes of it inside a Python communication hook), print ``CAUGHT
<unix time> <classes> | <message>``, save its parameters to CHECKPOINT_DIR/rank<r>.pt,
print ``SAVED``, destroy the process group and exit 0. On the "p2pcoll" backend it prints
``ON LANE <n>`` after CAUGHT: how many messages it sent on TCP lanes. Anything else escapes and fails
the rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_ddp import wrap

MAX_SECONDS = 120  # the test kills a rank long before; a rank that trains on stops here


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())  # one write per line: the test reads them as they come


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter, with no collective (FSDP2's are sharded DTensors)."""
    p = p.detach()
    return p.to_local() if hasattr(p, "to_local") else p


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["plain", "fp16", "powersgd", "fsdp"])
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("--backend", default="p2pcoll")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = wrap(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                     torch.nn.Linear(128, 10)),
                 argparse.Namespace(fsdp=args.mode == "fsdp",
                                    hook=args.mode if args.mode in ("fp16", "powersgd")
                                    else None))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    start = time.monotonic()
    step = 0
    try:
        while time.monotonic() - start < MAX_SECONDS:
            x = torch.randn(16, 64, generator=data)
            y = torch.randint(0, 10, (16,), generator=data)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            say(f"STEP {step}")
    except RuntimeError as exc:  # DistBackendError is one
        caught = time.time()
        kinds = ",".join(c.__name__ for c in type(exc).__mro__
                         if c.__module__.startswith(("torch", "p2pcoll")))
        message = " ".join(str(exc).split())
        say(f"CAUGHT {caught:.6f} {type(exc).__name__}[{kinds}] | {message}")
        if args.backend == "p2pcoll":
            from p2pcoll.integrations.torch.hooks import p2pcoll_group

            counters = p2pcoll_group().group.session.transport.counters
            say(f"ON LANE {counters.messages_sent_lane}")
        args.checkpoints.mkdir(parents=True, exist_ok=True)
        torch.save({"step": step, "params": [local(p) for p in model.parameters()]},
                   args.checkpoints / f"rank{rank}.pt")
        say("SAVED")
    else:
        say("NO ERROR")
        raise SystemExit(1)
    dist.destroy_process_group()
    del model, opt
    gc.collect()


if __name__ == "__main__":
    main()
