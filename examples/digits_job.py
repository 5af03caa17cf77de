"""The digits training of ``train_digits.py`` as the job of a peer service.

    p2pcoll peer --job examples.digits_job:job                  # from the repository's root
    p2pcoll launch -n 4 -- p2pcoll peer --job examples.digits_job:job

This is what the container image runs by default (``Dockerfile``, ``examples/compose.yaml``,
``examples/k8s/``). It trains the same model, on the same data, with the same rounds as
``train_digits.py`` (whose functions it uses), but reports through :mod:`logging` instead of a
progress bar: the loss and accuracy after each epoch, then the test accuracy and a digest of
the final weights, which is the same on every rank (the replicas are bit-for-bit equal, and
``check_replicas`` has said so before the digest is logged). It returns 0.

Knobs, from the environment (``p2pcoll peer`` passes the job only the group):

- ``DIGITS_EPOCHS``: epochs to train (default 10, a second or two of CPU on four peers);
- ``DIGITS_HOLD_SECONDS``: once trained, stay in the group, ready, this long before leaving
  together (default 0), so that a health check or a Prometheus scrape can see the finished
  group; a container test uses it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os

import p2pcoll
from p2pcoll import training

from .train_digits import Params, accuracy, batches, load_data, parse_args, train

log = logging.getLogger(__name__)


def weights_digest(params: Params) -> str:
    """A digest of the weights' names, dtypes, shapes and bytes: equal replicas, equal digest."""
    h = hashlib.sha256()
    for name, leaf in training.named_leaves(params):
        h.update(f"{name}:{leaf.dtype.str}:{leaf.shape};".encode())
        h.update(leaf.tobytes())
    return h.hexdigest()[:16]


def _env_number(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"${name}={raw!r}: expected a number >= {minimum:g}")
    return value


async def job(group: p2pcoll.Group) -> int:
    """Train the digits classifier data-parallel in ``group``; 0 when done."""
    args = parse_args([])
    args.epochs = int(_env_number("DIGITS_EPOCHS", 10, 1))
    hold = _env_number("DIGITS_HOLD_SECONDS", 0, 0)
    x, x_test, y, y_test = load_data(args.seed)
    rounds_per_epoch = len(batches(len(y), args.batch, 0, args.seed))
    log.info("training %d epochs of %d rounds (global batch %d) on %d peers, %d images",
             args.epochs, rounds_per_epoch, args.batch, group.world_size, len(y))

    done = 0

    def on_round(epoch: int, loss: float, hits: float) -> None:
        nonlocal done
        done += 1
        if done % rounds_per_epoch == 0:
            log.info("epoch %d/%d: loss %.4f, batch accuracy %.1f%%",
                     epoch + 1, args.epochs, loss, 100 * hits)

    params, _ = await train(group, args, x, y, on_round)
    log.info("test accuracy %.2f%%; weights digest %s (replicas checked equal)",
             100 * accuracy(params, x_test, y_test), weights_digest(params))
    if hold:
        log.info("holding the group for %gs (DIGITS_HOLD_SECONDS)", hold)
        await asyncio.sleep(hold)
        await group.barrier()  # leave together: nobody's peers see it go while they hold
    return 0
