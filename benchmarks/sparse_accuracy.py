"""slow_training.py's final accuracies without its lab: the same training in one process.

    python benchmarks/sparse_accuracy.py                          # fp32, int8 and topk2bit DiLoCo
    python benchmarks/sparse_accuracy.py --modes diloco_topk2bit --seeds 0,1,2

Not a test: it prints one markdown table. The four workers of ``slow_training.py`` (the same
MLP 64 -> 2048 -> 1024 -> 10, the same initial weights, the same batches of digits, Adam at
``--lr`` on every worker) run in this process, one after the other at each step, on memory
groups: the exchanges are the same calls on the same arrays, so the final accuracies are
slow_training.py's (96.39 % for 0.21.0's ``diloco_topk2bit`` and 97.78 % for ``fp32`` at 300
steps, seed 0, as its lab gave), in a few minutes and without a lab that a crowded machine
breaks (a worker starved for longer than the heartbeat timeout is declared lost). It says
nothing about time or the wire; slow_training.py does. Per mode and seed: the final test
accuracy, the test loss (cross-entropy: less coarse than 360 images' accuracy), and whether
the replicas' global parameters ended bit-identical.

- ``fp32``: per step, the four workers' gradients averaged (in torch) before each Adam step;
- ``diloco``: ``DiLoCo(inner_steps=50, codec="int8")``, the outer step DiLoCo's (lr 0.7,
  Nesterov momentum 0.9);
- ``diloco_async``: the same with ``delay=1`` (asynchronous DiLoCo: each round's average
  applied one round late);
- ``diloco_topk2bit``: as ``slow_training.py``'s: ``compressor="topk2bit", density=0.015``
  with ``outer_lr=2.0, outer_momentum=0.0``;
- ``diloco_topk2bit_nesterov``: the same compressor with DiLoCo's outer step.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slow_training import batch_of, load_data, make_model  # beside this file

WORLD = 4

def _diloco(**kwargs: Any) -> Callable[[Any, dict[str, Any]], Any]:
    def make(group: Any, params: dict[str, Any]) -> Any:
        from p2pcoll import training

        return training.DiLoCo(group, params, inner_steps=50, **kwargs)
    return make


# Each DiLoCo mode: how its object is made on a group, from the parameters.
DILOCO: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "diloco": _diloco(codec="int8"),
    "diloco_async": _diloco(codec="int8", delay=1),
    "diloco_topk2bit": _diloco(compressor="topk2bit", density=0.015, outer_lr=2.0,
                               outer_momentum=0.0),
    "diloco_topk2bit_nesterov": _diloco(compressor="topk2bit", density=0.015),
}
MODES = ["fp32", *DILOCO]


async def train(mode: str, args: argparse.Namespace, seed: int) -> tuple[float, float, bool]:
    """Final test accuracy, test loss and whether the replicas ended equal."""
    import torch
    from torch.func import functional_call

    from p2pcoll.testing import memory_groups

    x_train, y_train, x_test, y_test = load_data()
    models = [make_model(args.widths, seed) for _ in range(WORLD)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=args.lr) for m in models]
    loss_fn = torch.nn.CrossEntropyLoss()

    def backward(rank: int, step: int) -> None:
        idx = batch_of(step, len(y_train), args.batch, seed)[rank::WORLD]
        optimizers[rank].zero_grad()
        loss_fn(models[rank](x_train[idx]), y_train[idx]).backward()

    if mode == "fp32":
        for step in range(1, args.steps + 1):
            for rank in range(WORLD):
                backward(rank, step)
            for tensors in zip(*(m.parameters() for m in models), strict=True):
                mean = sum(p.grad for p in tensors) / WORLD
                for p in tensors:
                    p.grad = mean.clone()
            for o in optimizers:
                o.step()
        shared = [dict(m.named_parameters()) for m in models]
    else:
        groups = await memory_groups(WORLD)
        try:
            dilocos = [DILOCO[mode](g, {n: p.data for n, p in m.named_parameters()})
                       for g, m in zip(groups, models, strict=True)]
            for step in range(1, args.steps + 1):
                for rank in range(WORLD):
                    backward(rank, step)
                    optimizers[rank].step()
                await asyncio.gather(*(d.after_inner_step() for d in dilocos))
            await asyncio.gather(*(d.flush() for d in dilocos))
        finally:
            for g in groups:
                await g.close()
        shared = [{n: torch.as_tensor(a) for n, a in d.global_state()["params"].items()}
                  for d in dilocos]
    digests = set()
    for tree in shared:
        h = hashlib.blake2b(digest_size=8)
        for _, p in sorted(tree.items()):
            h.update(p.detach().contiguous().numpy().tobytes())
        digests.add(h.hexdigest())
    with torch.no_grad():
        logits = functional_call(models[0], shared[0], (x_test,))
        accuracy = float((logits.argmax(dim=1) == y_test).float().mean())
        loss = float(torch.nn.functional.cross_entropy(logits, y_test))
    return accuracy, loss, len(digests) == 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"from {', '.join(MODES)}")
    parser.add_argument("--seeds", default="0", help="comma-separated (0)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--widths", default="64,2048,1024,10")
    args = parser.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {MODES}")
    import torch

    import p2pcoll

    torch.set_num_threads(1)
    print(f"p2pcoll {p2pcoll.__version__} from {Path(p2pcoll.__file__).parent}; "
          f"{args.steps} steps, {WORLD} workers in one process\n")
    print("| mode | seed | final acc | test loss | replicas |\n|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        for mode in modes:
            accuracy, loss, equal = asyncio.run(train(mode, args, seed))
            print(f"| {mode} | {seed} | {accuracy:.2%} | {loss:.4f} | "
                  f"{'equal' if equal else 'DIFFER'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
