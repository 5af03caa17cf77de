"""DiLoCo with one bad peer: the outer reduction as ``avg``, ``median`` and ``trimmed_mean``.

    python benchmarks/robust_training.py                 # 8 peers, 40 outer rounds of H = 10
    python benchmarks/robust_training.py --rounds 10     # a quick look

Not a test: it prints one markdown table. Eight peers train one model in one process over
the memory transport (the figures are accuracies, not times): an MLP 64 -> 128 -> 10 (ReLU,
torch on the CPU, one thread) on scikit-learn's digits (1437 training and 360 test images,
stratified), each peer stepping Adam at ``--lr`` on its own eighth of a global batch of
``--batch`` images, and every ``--inner`` steps an outer Nesterov step (lr 0.7, momentum
0.9) on the pseudo-gradients combined by ``DiLoCo(..., op=...)``.

In the attacked runs one peer (rank 7) sends its pseudo-gradient scaled by ``--scale``
(100) every round: just before each exchange it moves its parameters to
``anchor - scale * (anchor - params)``. Per run: the final test accuracy of the global
parameters, the best accuracy on the way, and whether the eight replicas' global
parameters ended bit-identical (a digest of every tensor, compared across the peers).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
from typing import Any

import numpy as np
from slow_training import load_data  # the same digits and split (beside this file)

RUNS = (  # (name, op, trim, attacked)
    ("clean avg", "avg", None, False),
    ("attacked avg", "avg", None, True),
    ("attacked median", "median", None, True),
    ("attacked trimmed_mean (trim=1)", "trimmed_mean", 1, True),
    ("clean median", "median", None, False),
    ("clean trimmed_mean (trim=1)", "trimmed_mean", 1, False),
)
PEERS = 8
BAD = 7


def make_model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def accuracy(model: Any, params: dict[str, np.ndarray], x: Any, y: Any) -> float:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
        out = model(x)
        if not torch.isfinite(out).all():
            return 0.0
        return float((out.argmax(1) == y).float().mean()) * 100


def digest(tree: dict[str, np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tree):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tree[name]).tobytes())
    return h.hexdigest()


async def peer(group: Any, args: argparse.Namespace, op: str, trim: int | None,
               attacked: bool, data: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
    import torch

    from p2pcoll import training

    x_train, y_train, x_test, y_test = data
    model = make_model(args.seed)
    params = {name: p.detach().numpy() for name, p in model.named_parameters()}
    diloco = training.DiLoCo(group, params, inner_steps=args.inner, op=op, trim=trim)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    probe = make_model(args.seed)
    n, share = len(x_train), args.batch // PEERS
    best = 0.0
    for step in range(1, args.rounds * args.inner + 1):
        per_epoch = n // args.batch
        epoch, i = divmod(step - 1, per_epoch)
        order = np.random.default_rng([args.seed, epoch]).permutation(n)
        batch = order[i * args.batch:(i + 1) * args.batch]
        mine = batch[group.rank * share:(group.rank + 1) * share]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
        loss.backward()
        optimizer.step()
        if attacked and group.rank == BAD and step % args.inner == 0:
            with torch.no_grad():
                for name, anchor in zip(diloco.model.names, diloco.anchor, strict=True):
                    p = params[name]
                    p[...] = anchor - np.float32(args.scale) * (anchor - p)
        if await diloco.after_inner_step() and group.rank == 0:
            best = max(best, accuracy(probe, diloco.global_state()["params"], x_test, y_test))
    await diloco.flush()
    shared = diloco.global_state()["params"]
    return {"digest": digest(shared), "best": best,
            "final": accuracy(probe, shared, x_test, y_test) if group.rank == 0 else 0.0}


async def run(args: argparse.Namespace, op: str, trim: int | None, attacked: bool,
              data: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
    from p2pcoll.testing import memory_groups

    groups = await memory_groups(PEERS, collective_timeout=120)
    try:
        results = await asyncio.gather(*(peer(g, args, op, trim, attacked, data)
                                         for g in groups))
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    return {"final": results[0]["final"], "best": results[0]["best"],
            "equal": len({r["digest"] for r in results}) == 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="outer rounds")
    parser.add_argument("--inner", type=int, default=10, help="H, inner steps per round")
    parser.add_argument("--batch", type=int, default=128, help="global batch (8 shares)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's inner lr")
    parser.add_argument("--scale", type=float, default=100.0, help="the bad peer's factor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default="", help="names to run (comma-separated "
                        "substrings; default all)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    data = load_data()
    wanted = [w for w in args.runs.split(",") if w]
    print(f"8 peers, DiLoCo H = {args.inner}, {args.rounds} outer rounds, global batch "
          f"{args.batch}, rank {BAD} scales its pseudo-gradient by {args.scale:g} in the "
          f"attacked runs\n")
    print("| run | final accuracy | best accuracy | replicas bit-identical | wall s |")
    print("|---|---:|---:|---|---:|")
    for name, op, trim, attacked in RUNS:
        if wanted and not any(w in name for w in wanted):
            continue
        started = time.perf_counter()
        got = asyncio.run(run(args, op, trim, attacked, data))
        print(f"| {name} | {got['final']:.2f} % | {got['best']:.2f} % | "
              f"{'yes' if got['equal'] else 'NO'} | {time.perf_counter() - started:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
