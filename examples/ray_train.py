"""Ray Train on p2pcoll: examples/train_ddp.py's model and loop under ``TorchTrainer``.

    pip install -e '.[examples,ray]'
    python examples/ray_train.py                           # p2pcoll, 4 workers, a local Ray
    python examples/ray_train.py --backend p2pcoll gloo    # both, then compare the weights
    python examples/ray_train.py --address auto            # an existing Ray cluster

The only p2pcoll-specific thing is the backend's name:
``TorchTrainer(..., torch_config=TorchConfig(backend="p2pcoll"))``. Ray Train starts the
workers and calls ``torch.distributed.init_process_group("p2pcoll", init_method=...)`` in
each; installing p2pcoll registers that backend with torch. The training loop is
train_ddp.py's (its ``wrap`` and the same model, data and steps): DDP over the digits, every
worker on its own shard of each global batch. Each worker ends by checking that all ranks
hold bit-identical parameters, and rank 0 reports their SHA-256. With ``--backend p2pcoll
gloo`` both runs happen in one Ray session and the script checks that they end with the
same weights (p2pcoll adds in Gloo's order, see train_ddp.py).

``--die-rank R --die-step S`` makes worker R kill itself (SIGKILL) at step S, while the
others wait for it in DDP's allreduce, to show Ray Train's failure handling: Ray notices the
dead actor, stops the survivors (whose collectives end with p2pcoll's error, PeerLost or
GroupBroken, instead of hanging) and ``trainer.fit()`` raises Ray Train's
error (a ``WorkerGroupError``, a ``TrainingFailedError``) naming the rank that died; with
``--max-failures 1 --die-once MARKER`` Ray Train starts the workers again, p2pcoll forms a new
group and the run ends with the weights of an undisturbed one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

HERE = Path(__file__).resolve().parent


def die(rank: int, step: int, marker: str | None) -> None:
    """SIGKILL this worker, or (with a ``marker`` file, made here) only the first time."""
    if marker is not None:
        if os.path.exists(marker):
            return
        Path(marker).touch()
    print(f"rank {rank}: killing myself at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def train_loop(config: dict[str, Any]) -> None:
    """One worker: train_ddp.py's training, on the process group Ray Train set up."""
    import ray.train
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from train_ddp import full, wrap  # this folder, the workers' working directory

    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: results independent of cores
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    options = argparse.Namespace(fsdp=False, hook=None)
    model = wrap(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)), options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    batch_size = config["batch"]
    per_rank = batch_size // size
    step = 0
    for _epoch in range(config["epochs"]):
        total = 0.0
        for start in range(0, len(x) - batch_size + 1, batch_size):
            if rank == config["die_rank"] and step == config["die_step"]:
                die(rank, step, config["die_marker"])
            batch = order[start + rank * per_rank:start + (rank + 1) * per_rank]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            total += loss.item()
            step += 1
    flat = torch.cat([full(p).reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    identical = all(torch.equal(everyone[0], other) for other in everyone)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    metrics = {"sha256": digest, "identical": identical, "steps": step,
               "last_epoch_loss": total}
    # Ray Train keeps the metrics that come with a checkpoint: rank 0 saves the weights
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            torch.save(flat, os.path.join(folder, "weights.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)


def fit(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """One TorchTrainer run on ``backend``; rank 0's report.

    Raises:
        ray.train.TrainingFailedError: a worker failed (more than ``--max-failures`` times).
    """
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"epochs": args.epochs, "batch": args.batch,
                           "die_rank": args.die_rank, "die_step": args.die_step,
                           "die_marker": args.die_once},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(name=f"ray-train-{backend}", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    if result.metrics is None:
        raise RuntimeError(f"{backend}: Ray Train returned no metrics (no report from rank 0)")
    return dict(result.metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", nargs="+", choices=["p2pcoll", "gloo"],
                        default=["p2pcoll"], help="one run per backend, in this order")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--address", default=None,
                        help="an existing Ray cluster (e.g. auto); default: a local instance")
    parser.add_argument("--storage", default=str(Path("/tmp") / "p2pcoll-ray-train"),
                        help="Ray Train's storage path (results, checkpoints)")
    parser.add_argument("--die-rank", type=int, default=-1, help="a worker that kills itself")
    parser.add_argument("--die-step", type=int, default=5, help="... at this step")
    parser.add_argument("--die-once", metavar="MARKER", default=None,
                        help="die only if this file does not exist yet (and create it): "
                        "the run Ray Train restarts completes")
    parser.add_argument("--max-failures", type=int, default=0,
                        help="Ray Train's restarts after a failure")
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1"}
    env.update({k: v for k, v in os.environ.items() if k.startswith("P2PCOLL_")})
    runtime_env = {"working_dir": str(HERE), "excludes": ["*.png", "custom_strategy", "k8s"],
                   "env_vars": env}
    if args.address is None:
        ray.init(num_cpus=args.workers, include_dashboard=False, runtime_env=runtime_env)
    else:
        ray.init(address=args.address, runtime_env=runtime_env)
    digests = {}
    for backend in args.backend:
        metrics = fit(backend, args)
        print(f"{backend}: {args.workers} workers, {metrics['steps']} steps, parameters "
              f"identical on all ranks: {metrics['identical']}, sha256 "
              f"{metrics['sha256'][:16]}", flush=True)
        if not metrics["identical"]:
            sys.exit(1)
        digests[backend] = metrics["sha256"]
    if len(set(digests.values())) > 1:
        print(f"the backends' weights differ: {digests}", flush=True)
        sys.exit(1)
    if len(digests) > 1:
        print(f"same weights on {' and '.join(digests)}", flush=True)


if __name__ == "__main__":
    main()
