"""N async Ray actors form a p2pcoll group and train the digits model data-parallel.

    pip install -e '.[examples,ray]'
    python examples/ray_actors.py --workers 4             # a local Ray instance
    python examples/ray_actors.py --address auto          # an existing Ray cluster

For users who outgrow one machine on a Ray cluster. Every actor is one p2pcoll peer: an
``async def`` method joins the group in the actor's own event loop and trains there. Ray
only places the actors and carries their results; the gradients go between the actors over
p2pcoll's own sockets, never through Ray's object store.

Who meets where: the driver creates the actors, asks actor 0 for an address on its own node
(the node's IP and a port free there) and gives every actor that rendezvous, its index as
rank and N as the world size. Actor 0, asking for rank 0, hosts the rendezvous there, as
``join()`` always does (:mod:`p2pcoll.session.forming`); the others register with it.

The model, the data and the training rounds are ``examples/train_digits.py``'s (imported,
not copied; Ray ships this folder to the actors as their working directory), and so are the
options besides ``--workers``, ``--address``, ``--timeout`` and ``--key-file``: each round
every actor computes the gradient over its share of the global batch, the group sums the
shares with ``p2pcoll.training.allreduce_gradients`` and every actor applies the same SGD
step. Each actor returns its test accuracy and a SHA-256 of its final weights; the driver
checks that every digest is the same and prints the accuracy.

On a cluster: p2pcoll (with the examples extra) installed on every node, and the nodes able
to reach each other on TCP ports (each peer binds an ephemeral port; the rendezvous is on
actor 0's node). ``--key-file`` secures the group with a job key (``p2pcoll keygen PATH``;
the file at that path on every node).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import socket
import sys
import time
from pathlib import Path
from typing import Any

import ray
import train_digits  # this folder: the model, the data and the training rounds

import p2pcoll

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    """``--workers``, ``--address``, ``--timeout``, ``--key-file``; the rest are
    train_digits.py's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Other "
                                     "options (--epochs, --batch, --lr, ...) are "
                                     "train_digits.py's.")
    parser.add_argument("--workers", type=int, default=4, help="actors, the world size")
    parser.add_argument("--address", default=None,
                        help="an existing Ray cluster (e.g. auto); default: a local instance")
    parser.add_argument("--timeout", type=float, default=60, help="seconds to form the group")
    parser.add_argument("--key-file", default=None, help="the job key (p2pcoll keygen PATH)")
    ours, rest = parser.parse_known_args()
    args = train_digits.parse_args([*rest, "--no-plot"])
    for name, value in vars(ours).items():
        setattr(args, name, value)
    return args


def digest(params: dict[str, Any]) -> str:
    """SHA-256 of the weights' names, dtypes, shapes and bytes: equal only if bit for bit."""
    h = hashlib.sha256()
    for name in sorted(params):
        array = params[name]
        h.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        h.update(array.tobytes())
    return h.hexdigest()


@ray.remote
class Worker:
    """One peer of the group: rank ``rank`` of ``world_size``."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def address(self) -> str:
        """``tcp://NODE_IP:PORT`` with a port free on this actor's node right now."""
        host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    async def train(self, rendezvous: str, args: argparse.Namespace) -> dict[str, Any]:
        """Join, train on this rank's shares (train_digits.train), leave."""
        x, x_test, y, y_test = train_digits.load_data(args.seed)
        async with p2pcoll.join(rendezvous, world_size=self.world_size, rank=self.rank,
                                timeout=args.timeout, key_file=args.key_file) as g:
            started = time.perf_counter()
            params, losses = await train_digits.train(g, args, x, y)  # replicas checked
            return {"rank": g.rank, "accuracy": train_digits.accuracy(params, x_test, y_test),
                    "digest": digest(params), "rounds": len(losses), "loss": losses[-1],
                    "seconds": time.perf_counter() - started}


async def main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    runtime_env = {"working_dir": str(HERE), "excludes": ["*.png", "custom_strategy"]}
    if args.address is None:
        ray.init(num_cpus=args.workers, include_dashboard=False, runtime_env=runtime_env)
    else:
        ray.init(address=args.address, runtime_env=runtime_env)
    try:
        make = Worker.remote  # type: ignore[attr-defined]
        workers = [make(r, args.workers) for r in range(args.workers)]
        rendezvous = await workers[0].address.remote()
        print(f"{args.workers} actors; rendezvous at {rendezvous} (actor 0 hosts it); "
              f"Ray and actor 0 up in {time.perf_counter() - started:.1f}s")
        results = await asyncio.gather(*(w.train.remote(rendezvous, args) for w in workers))
    finally:
        ray.shutdown()
    for r in results:
        print(f"rank {r['rank']}: {r['rounds']} rounds in {r['seconds']:.2f}s, final loss "
              f"{r['loss']:.4f}, test accuracy {r['accuracy']:.2%}, weights {r['digest'][:16]}")
    digests = {r["digest"] for r in results}
    if len(digests) != 1:
        print(f"FAILED: {len(digests)} different weights among {len(results)} actors")
        return 1
    print(f"all {len(results)} actors hold identical weights (sha256 {digests.pop()[:16]}); "
          f"test accuracy {results[0]['accuracy']:.2%}")
    print(f"done in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
