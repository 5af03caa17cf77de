"""DDP on "p2pcoll" that loses a rank and keeps training on the survivors, with torch's own
``dist.shrink_group``: no restart, no checkpoint, the model state each survivor holds.

    python examples/torch_shrink.py                       # 4 ranks; rank 2 SIGKILLs itself
    python examples/torch_shrink.py --world 8 --victim 5 --kill-at 20 --signal STOP --abort

Run as it is, it starts ``--world`` ranks of itself (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, as torchrun sets them) and waits for them; torchrun's agent would stop every
rank once one dies, which is what this example shows is no longer needed. Rank
``--victim`` sends itself ``--signal`` (KILL, or STOP: frozen, found after the heartbeat
timeout) at step ``--kill-at``. Each survivor catches DDP's error, asks the process group
which ranks it lost (``lost_ranks()``), shrinks the default group without them, wraps the
model in a new DDP and does the step again. The loss curve goes on where it was; at the
end every survivor prints a digest of its parameters, the same on all.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time

SEED = 0


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())  # one write per line: ranks share the terminal


def launch(args: argparse.Namespace) -> int:
    """Start the ranks, wait for the survivors, then stop the victim if it is frozen."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(args.world), "P2PCOLL_HEARTBEAT_TIMEOUT":
           os.environ.get("P2PCOLL_HEARTBEAT_TIMEOUT", "2")}
    ranks = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]],
                              env={**env, "RANK": str(r)}) for r in range(args.world)]
    codes = [p.wait() for r, p in enumerate(ranks) if r != args.victim]
    ranks[args.victim].kill()  # frozen (STOP) until now, or already dead
    ranks[args.victim].wait()
    return max(codes, default=0)


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import SHRINK_ABORT, SHRINK_DEFAULT
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("p2pcoll")
    me = dist.get_rank()  # the launch rank; dist.get_rank() is renumbered by a shrink
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    target = torch.nn.Linear(16, 1)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    while step < args.steps:
        if me == args.victim and step == args.kill_at:
            os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))
        # The whole batch is the same on every rank; each takes its share of it.
        g = torch.Generator().manual_seed(step)
        x = torch.randn(240, 16, generator=g)
        with torch.no_grad():
            y = target(x) + 0.1 * torch.randn(240, 1, generator=g)
        rank, size = dist.get_rank(), dist.get_world_size()
        xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
        try:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(xs), ys)
            loss.backward()  # DDP's allreduce of the gradients: raises if a rank is lost
        except RuntimeError as exc:
            pg = dist.group.WORLD
            lost = pg.lost_ranks()  # type: ignore[union-attr]
            say(f"rank {me}: step {step} failed ({str(exc).splitlines()[0][:90]}...)")
            started = time.perf_counter()
            dist.shrink_group(lost, shrink_flags=SHRINK_ABORT if args.abort
                              else SHRINK_DEFAULT)
            took = time.perf_counter() - started
            say(f"rank {me}: shrank without ranks {lost} in {took * 1e3:.0f} ms: now rank "
                f"{dist.get_rank()} of {dist.get_world_size()}")
            ddp = DDP(model)  # the same parameters on every survivor: the step never ran
            continue  # do the step again, on the survivors
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if dist.get_rank() == 0:
            say(f"step {step:3d}  loss {mean.item():.5f}  world {dist.get_world_size()}")
        step += 1
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    say(f"rank {me}: DONE parameters {digest}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    parser.add_argument("--abort", action="store_true",
                        help="shrink with SHRINK_ABORT (end the old group's calls first)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(args))
    train(args)


if __name__ == "__main__":
    main()
