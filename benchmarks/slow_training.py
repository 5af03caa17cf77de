"""Data-parallel training over slow links, one line per mode: time to accuracy, bytes, replicas.

    python benchmarks/slow_training.py                       # 100 Mbit/s, 25 ms, every mode
    python benchmarks/slow_training.py --link 1gbit          # 1 Gbit/s, 0.5 ms
    python benchmarks/slow_training.py --modes fp32,gloo_ddp --steps 20     # a short run

Not a test: it prints one markdown table and writes one plot (``--plot``: accuracy against
wall time, one line per mode). Needs root, ``ip``/``tc``/``nft`` and the examples' and
torch's extras (scikit-learn, matplotlib, torch).

Four workers, each on a host of its own: a network namespace of ``tests/netns.py``'s lab,
with its own ``P2PCOLL_HOST_ID`` (so p2pcoll never uses shared memory or ipc between them,
though the namespaces share /dev/shm), every cable a token bucket of ``--rate`` each way and
a one-way delay of ``--delay`` (netem where the kernel has it, else a relay in each host
that holds every TCP stream's bytes that long each way: see :meth:`netns.Lab.delay`).

Every mode trains the same model from the same initial weights on the same batches: an MLP
64 -> 2048 -> 1024 -> 10 (2.24 M parameters, ReLU; torch on the CPU, one thread per worker)
on scikit-learn's digits (1437 training and 360 test images, stratified), a global batch of
``--batch`` images per step split evenly over the workers, Adam at ``--lr`` on every worker.
The modes differ only in what the workers exchange:

- ``fp32``: every step, the gradients averaged by ``training.allreduce_gradients``;
- ``fp16``, ``int8_ef``: the same with ``codec="fp16"`` / ``codec="int8"`` (int8 with error
  feedback);
- ``powersgd``: ``training.PowerSGD(rank=4)`` (error feedback, warm start);
- ``topk``: ``training.TopK(fraction=0.01)`` (error feedback, over allgather);
- ``local_sgd``: H = 8 local steps, then the parameters averaged;
- ``diloco``: H = 50 inner steps, then an outer Nesterov step on the averaged
  pseudo-gradients, sent as int8;
- ``diloco_async``: asynchronous DiLoCo (int8, H = 50, ``delay=1``): each round's reduction
  runs during the next round's inner steps and is applied one round late;
- ``diloco_h100``: DiLoCo (int8) with H = 100 (not one of the issue's: the setting behind
  OpenDiLoCo's and INTELLECT-1's 400x; H = 50 with int8 gives 200x);
- ``diloco_fp32``: DiLoCo with float32 pseudo-gradients (no codec; not one of the issue's);
- ``streaming_diloco``: DiLoCo (int8) in F = 3 fragments synchronised at staggered steps,
  each exchange overlapping 5 inner steps, merged with alpha = 0.5;
- ``diloco_topk2bit``: DiLoCo (H = 50) with sparse 2-bit pseudo-gradients,
  ``compressor="topk2bit", density=0.015`` (1.5 % of each chunk of 4096, error feedback
  decaying by 0.95 a round) and the outer step for it, ``outer_lr=2.0, outer_momentum=0.0``;
- ``diloco_async_topk2bit``: the two together, asynchronous DiLoCo (``delay=1``) with
  topk2bit's pseudo-gradients and SparseLoCo's outer step, lr 1 without momentum (the
  accumulator is the momentum; not one of the issue's);
- ``gloo_ddp``: torch's DistributedDataParallel over Gloo (tcp), the reference.

``--scaling 4,8,16`` measures instead, without namespaces, how the bytes of one DiLoCo
round grow with the number of peers: the MLP's shapes on memory-transport groups of each
size, fp32 per-step allreduce against topk2bit, bytes sent per rank from ``group.stats()``.

A mode p2pcoll does not have (yet) is reported as "not available", with the reason. Adding
one is one function in MODES.

Per mode: the wall time of the training loop (from the first step to the last, test
evaluations left out), the time at which the test accuracy first reached ``--target``
(evaluated every ``--eval-every`` steps where the replicas are equal: after each
synchronisation, for the local modes), the final test accuracy, the bytes each worker sent:
the payload from ``group.stats()`` and the frames its cable's counters saw (joining and
barriers included), per step and in all; and whether the four replicas ended bit-identical
(a digest of every parameter, compared across the workers); for the local modes, the share of
the wall time spent in inner steps (backward and optimizer step, timed in their thread).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import gloo_peer  # noqa: E402  # beside this file
import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path
from peer_processes import peer_environment, run_to_end  # noqa: E402  # tests/, likewise

WORLD = 4
PORT = 29500
LINKS = {"100mbit": ("100mbit", "25ms"), "1gbit": ("1gbit", "0.5ms")}


class NotAvailable(Exception):
    """A mode that this p2pcoll does not have; the message says what is missing."""


# --- the model and the data ------------------------------------------------------------------

def load_data() -> tuple[Any, Any, Any, Any]:
    """Digits as float32 tensors in [0, 1]: (x_train, y_train, x_test, y_test)."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    return (torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train),
            torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test))


def make_model(widths: list[int], seed: int) -> Any:
    """The MLP ``widths[0] -> ... -> widths[-1]`` with ReLU, the same weights for a seed."""
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    for i, (a, b) in enumerate(pairwise(widths)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def batch_of(step: int, n: int, batch: int, seed: int) -> Any:
    """The global batch of ``step`` (1-based): the same on every worker."""
    import numpy as np

    per_epoch = n // batch
    epoch, i = divmod(step - 1, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[i * batch:(i + 1) * batch]


# --- the modes -------------------------------------------------------------------------------
#
# A mode is a function of the options that returns an Update, or raises NotAvailable. Its
# ``step(group, model, optimizer, step)`` runs after every backward pass: it exchanges what
# the mode exchanges, steps the optimizer and says whether the parameters the replicas share
# may be evaluated now. ``shared(model)`` is what they share (the model's parameters; DiLoCo's
# global parameters), the parameters that are tested and compared; ``finish`` completes what
# is in flight at the end.

Step = Callable[[Any, Any, Any, int], Awaitable[bool]]


@dataclass
class Update:
    step: Step
    shared: Callable[[Any], dict[str, Any]] = field(
        default=lambda model: dict(model.named_parameters()))
    finish: Callable[[], Awaitable[Any]] | None = None
    kind: str = "p2pcoll"  # or "gloo": torch's DDP instead of a p2pcoll group
    stats: Callable[[], dict[str, Any]] = field(default=lambda: {})
    # The optimizer steps in the thread with the backward pass (the inner step of the local
    # modes), so exchanges in flight move during the whole inner step; ``step`` then only
    # counts it.
    inner_in_thread: bool = False
    # Made before the first step, from the group and the model (the local modes' object,
    # which takes the parameters as they start).
    prepare: Callable[[Any, Any], None] | None = None
    # Inner steps between exchanges (H; the local modes but streaming DiLoCo): ``step`` only
    # counts the others, so the worker's thread runs them back to back (one hand-over to
    # the thread per exchange, not per step) unless --hop-every-step.
    every: int | None = None


def _set_grads(model: Any, grads: dict[str, Any]) -> None:
    import torch

    for name, p in model.named_parameters():
        g = grads[name]
        p.grad = g if isinstance(g, torch.Tensor) else torch.from_numpy(g)


def _reducer(reduce: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]],
             **extra: Any) -> Update:
    """A mode that averages the gradients with ``reduce(group, grads)`` every step."""
    async def step(group: Any, model: Any, optimizer: Any, step_no: int) -> bool:
        grads = {name: p.grad for name, p in model.named_parameters()}
        _set_grads(model, await reduce(group, grads))
        optimizer.step()
        return True
    return Update(step, **extra)


def _codecs() -> None:
    """NotAvailable unless groups take ``codec=`` (helper A's codecs)."""
    from p2pcoll import Group, training

    for where, f in (("Group.allreduce", Group.allreduce),
                     ("training.allreduce_gradients", training.allreduce_gradients)):
        if "codec" not in inspect.signature(f).parameters:
            raise NotAvailable(f"{where} has no codec= yet")


def _training(name: str) -> Any:
    from p2pcoll import training

    found = getattr(training, name, None)
    if found is None:
        raise NotAvailable(f"p2pcoll.training has no {name} yet")
    return found


def _params(model: Any) -> dict[str, Any]:
    """The parameters as a pytree of the tensors' own storage (updated in place)."""
    return {name: p.data for name, p in model.named_parameters()}


def mode_fp32(args: argparse.Namespace) -> Update:
    from p2pcoll import training

    return _reducer(lambda g, grads: training.allreduce_gradients(g, grads, op="avg"))


def mode_fp16(args: argparse.Namespace) -> Update:
    from p2pcoll import training

    _codecs()
    return _reducer(lambda g, grads: training.allreduce_gradients(
        g, grads, op="avg", codec="fp16"))


def mode_int8_ef(args: argparse.Namespace) -> Update:
    from p2pcoll import training

    _codecs()
    return _reducer(lambda g, grads: training.allreduce_gradients(
        g, grads, op="avg", codec="int8"))


def mode_powersgd(args: argparse.Namespace) -> Update:
    reducer = _training("PowerSGD")(rank=4)
    return _reducer(reducer.allreduce, stats=lambda: {"ratio": reducer.traffic.ratio})


def mode_topk(args: argparse.Namespace) -> Update:
    reducer = _training("TopK")(fraction=0.01)
    return _reducer(reducer.allreduce, stats=lambda: {"ratio": reducer.traffic.ratio})


def _outer_loop(make: Callable[[Any, dict[str, Any]], Any], *, every_step: bool = False,
                every: int | None = None) -> Update:
    """A mode of inner steps and exchanges (LocalSGD, DiLoCo): ``make(group, params)``
    builds its object before the first step; the optimizer steps on each worker's own, in
    the inner step's thread. The
    replicas share the model's parameters after an exchange, or DiLoCo's global parameters
    at any step (``every_step``)."""
    made: list[Any] = []

    def prepare(group: Any, model: Any) -> None:
        made.append(make(group, _params(model)))

    async def step(group: Any, model: Any, optimizer: Any, step_no: int) -> bool:
        return bool(await made[0].after_inner_step()) or every_step

    def shared(model: Any) -> dict[str, Any]:
        import torch

        if not made or not hasattr(made[0], "global_state"):
            return dict(model.named_parameters())
        tree = made[0].global_state()["params"]
        return {name: torch.as_tensor(a) for name, a in tree.items()}

    async def finish() -> None:
        if made and hasattr(made[0], "flush"):
            await made[0].flush()

    return Update(step, shared=shared, finish=finish, inner_in_thread=True, prepare=prepare,
                  stats=lambda: {"ratio": made[0].traffic.ratio} if made else {}, every=every)


def mode_local_sgd(args: argparse.Namespace) -> Update:
    local_sgd = _training("LocalSGD")
    return _outer_loop(lambda g, params: local_sgd(g, params, inner_steps=8), every=8)


def mode_diloco(args: argparse.Namespace) -> Update:
    diloco = _training("DiLoCo")
    _codecs()
    return _outer_loop(lambda g, params: diloco(g, params, inner_steps=50, codec="int8"),
                       every=50)


def mode_diloco_async(args: argparse.Namespace) -> Update:
    """Asynchronous DiLoCo (int8, H = 50): round k's reduction runs during round k+1's
    inner steps and is applied one round late (``delay=1``)."""
    diloco = _training("DiLoCo")
    _codecs()
    if "delay" not in inspect.signature(diloco).parameters:
        raise NotAvailable("training.DiLoCo has no delay= yet")
    return _outer_loop(lambda g, params: diloco(g, params, inner_steps=50, codec="int8",
                                                delay=1), every=50)


def mode_diloco_h100(args: argparse.Namespace) -> Update:
    """Not one of the issue's modes: DiLoCo (int8) with H = 100, the setting behind the
    400x of OpenDiLoCo and INTELLECT-1 (4x from int8 times H = 100); H = 50 gives 200x."""
    diloco = _training("DiLoCo")
    _codecs()
    return _outer_loop(lambda g, params: diloco(g, params, inner_steps=100, codec="int8"),
                       every=100)


def mode_diloco_fp32(args: argparse.Namespace) -> Update:
    """Not one of the issue's modes: DiLoCo as above with the pseudo-gradients in float32,
    which needs no codec (so it runs where the codecs have not landed, and shows what int8
    saves on top)."""
    diloco = _training("DiLoCo")
    return _outer_loop(lambda g, params: diloco(g, params, inner_steps=50), every=50)


def mode_streaming_diloco(args: argparse.Namespace) -> Update:
    diloco = _training("DiLoCo")
    _codecs()
    return _outer_loop(lambda g, params: diloco(
        g, params, inner_steps=50, codec="int8", fragments=3, overlap=5, mix=0.5),
        every_step=True)


def mode_diloco_topk2bit(args: argparse.Namespace) -> Update:
    """topk2bit (its accumulator decaying by 0.95 a round, SparseLoCo's) with the outer
    step it needs: lr 2 without momentum. The decayed accumulator is the momentum, and each
    rank's 1.5 % is averaged over p where the ranks picked different entries, so a larger
    outer step (sparse_accuracy.py, 300 steps, 0.21.0's compressor, seed 0: lr 0.7 with
    momentum 0.9 96.39 %, lr 1 96.11 %, lr 2 96.94 %; seed 1: 95.28 % against 96.94 %)."""
    diloco = _training("DiLoCo")
    if "compressor" not in inspect.signature(diloco).parameters:
        raise NotAvailable("training.DiLoCo has no compressor= yet")
    return _outer_loop(lambda g, params: diloco(
        g, params, inner_steps=50, compressor="topk2bit", density=0.015, outer_lr=2.0,
        outer_momentum=0.0), every=50)


def mode_diloco_async_topk2bit(args: argparse.Namespace) -> Update:
    """Not one of the issue's modes: asynchronous DiLoCo (``delay=1``, H = 50) with the
    pseudo-gradients as topk2bit's (density 1.5 %): the compression overlaps the next
    round's inner steps too. The outer step is SparseLoCo's, lr 1 without momentum: the
    error-feedback accumulator already holds each entry back for rounds, and Nesterov
    momentum 0.9 on top of it plus the round of delay lag the global parameters behind the
    workers (300 steps, seeds 0-2: 92.2 % mean with DiLoCo's lr 0.7 and momentum 0.9,
    against 95.5 % synchronous; 96.5 % with lr 1 and no momentum, 96.1 % synchronous)."""
    diloco = _training("DiLoCo")
    if not {"compressor", "delay"} <= set(inspect.signature(diloco).parameters):
        raise NotAvailable("training.DiLoCo has no compressor= or delay= yet")
    return _outer_loop(lambda g, params: diloco(
        g, params, inner_steps=50, compressor="topk2bit", density=0.015, delay=1,
        outer_lr=1.0, outer_momentum=0.0), every=50)


def mode_gloo_ddp(args: argparse.Namespace) -> Update:
    async def step(group: Any, model: Any, optimizer: Any, step_no: int) -> bool:
        optimizer.step()  # DDP averaged the gradients during the backward pass
        return True
    return Update(step, kind="gloo")


MODES: dict[str, Callable[[argparse.Namespace], Update]] = {
    "fp32": mode_fp32,
    "fp16": mode_fp16,
    "int8_ef": mode_int8_ef,
    "powersgd": mode_powersgd,
    "topk": mode_topk,
    "local_sgd": mode_local_sgd,
    "diloco": mode_diloco,
    "diloco_async": mode_diloco_async,
    "diloco_h100": mode_diloco_h100,
    "diloco_fp32": mode_diloco_fp32,
    "streaming_diloco": mode_streaming_diloco,
    "diloco_topk2bit": mode_diloco_topk2bit,
    "diloco_async_topk2bit": mode_diloco_async_topk2bit,
    "gloo_ddp": mode_gloo_ddp,
}


# --- the worker (this file run with --worker on a host of the lab) ---------------------------

async def train(args: argparse.Namespace, update: Update, group: Any, model: Any,
                module: Any, rank: int, world: int) -> dict[str, Any]:
    """The training loop; returns this worker's report (curve, accuracy, digest, time).
    ``model`` is what is trained (torch's DDP wrapper, for Gloo), ``module`` the MLP."""
    import torch
    from torch.func import functional_call

    x_train, y_train, x_test, y_test = load_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    def accuracy() -> float:
        with torch.no_grad():
            logits = functional_call(module, update.shared(module), (x_test,))
            return float((logits.argmax(dim=1) == y_test).float().mean())

    def backward(idx: Any) -> None:
        optimizer.zero_grad(set_to_none=False)
        loss_fn(model(x_train[idx]), y_train[idx]).backward()

    def inner_steps(first: int, last: int) -> tuple[float, float, float]:
        """The local modes' inner steps ``first .. last``, back to back: backward and the
        optimizer's step, timed; when the first started, when the last ended, and the time
        in them."""
        began = time.perf_counter()
        busy = 0.0
        for s in range(first, last + 1):
            t = time.perf_counter()
            backward(batch_of(s, len(y_train), args.batch, args.seed)[rank::world])
            optimizer.step()
            took = time.perf_counter() - t
            busy += took
            step_times[s] = took
        return began, time.perf_counter(), busy

    step_times: dict[int, float] = {}  # each inner step's seconds (the local modes)
    if update.prepare is not None:
        update.prepare(group, module)
    curve = [(0.0, 0, accuracy())]
    paused = 0.0  # seconds spent evaluating, left out of the wall time
    computing = 0.0  # seconds in inner steps (the local modes): utilisation = computing / wall
    stepping = 0.0  # seconds in update.step (the exchanges' share of the loop thread)
    hops = 0.0  # seconds between handing an inner step to its thread and it starting, and
    # between its end and the loop going on
    last_eval = 0
    start = time.perf_counter()
    ran = 0  # the last inner step the thread ran (the local modes)
    for step in range(1, args.steps + 1):
        idx = batch_of(step, len(y_train), args.batch, args.seed)[rank::world]
        if update.kind == "gloo":
            backward(idx)  # DDP's hooks run on this thread
        elif update.inner_in_thread and step > ran:  # exchanges in flight move meanwhile
            last = step
            if update.every is not None and not args.hop_every_step:
                last = min(args.steps, step + (-step) % update.every)  # the next exchange's
            called = time.perf_counter()
            began, ended, busy = await asyncio.to_thread(inner_steps, step, last)
            computing += busy
            hops += (began - called) + (time.perf_counter() - ended) + (ended - began - busy)
            ran = last
        elif not update.inner_in_thread:
            await asyncio.to_thread(backward, idx)
        t_step = time.perf_counter()
        synced = await update.step(group, model, optimizer, step)
        stepping += time.perf_counter() - t_step
        if synced and step - last_eval >= args.eval_every:
            t = time.perf_counter()
            curve.append((t - start - paused, step, accuracy()))
            paused += time.perf_counter() - t
            last_eval = step
    t_finish = time.perf_counter()
    if update.finish is not None:
        await update.finish()
    finishing = time.perf_counter() - t_finish
    wall = time.perf_counter() - start - paused
    final = accuracy()
    if last_eval != args.steps:
        curve.append((wall, args.steps, final))
    h = hashlib.blake2b(digest_size=8)
    for _, p in sorted(update.shared(module).items()):
        h.update(p.detach().contiguous().numpy().tobytes())
    return {"rank": rank, "wall": wall, "final": final, "curve": curve,
            "digest": h.hexdigest(), "computing": computing, "stepping": stepping,
            "hops": hops, "finishing": finishing, **_contention(step_times, update.every),
            **update.stats()}


def _contention(step_times: dict[int, float], every: int | None) -> dict[str, float]:
    """The median inner step while the previous exchange is likely in flight (the first
    tenth of each round after the first) and in the rest of the rounds: what the exchange's
    work on the loop thread (and its CPU) costs the training thread."""
    if not every or len(step_times) < 2 * every:
        return {}
    early = [t for s, t in step_times.items() if s > every and (s - 1) % every < every // 10]
    late = [t for s, t in step_times.items() if s > every and (s - 1) % every >= every // 10]
    if not early or not late:
        return {}
    return {"step_early": float(sorted(early)[len(early) // 2]),
            "step_late": float(sorted(late)[len(late) // 2])}


async def p2pcoll_worker(args: argparse.Namespace, update: Update) -> dict[str, Any]:
    import p2pcoll

    async with p2pcoll.join() as g:
        model = make_model(args.widths, args.seed)
        await g.barrier()
        report = await train(args, update, g, model, model, g.rank, g.world_size)
        stats = g.stats()
        endpoints = [e for r, e in enumerate(g.membership.endpoints) if r != g.rank]
        report.update(bytes_sent=stats["bytes_sent"], bytes_received=stats["bytes_received"],
                      bytes_sent_shm=stats["bytes_sent_shm"],
                      messages_sent_lane=stats["messages_sent_lane"],
                      links=sorted({e.partition("://")[0] for e in endpoints}),
                      strategies=stats["collectives_by_strategy"])
        await g.barrier()
    return report


def gloo_worker(args: argparse.Namespace, update: Update) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    with gloo_peer.group(netns.address(0), args.port, timeout=600) as (rank, world):
        model = make_model(args.widths, args.seed)
        ddp = DistributedDataParallel(model)
        dist.barrier()
        report = asyncio.run(train(args, update, None, ddp, model, rank, world))
        report["links"] = ["tcp"]
    return report


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    update = MODES[args.mode](args)
    if update.kind == "gloo":
        report = gloo_worker(args, update)
    else:
        report = asyncio.run(p2pcoll_worker(args, update))
    print(json.dumps(report), flush=True)
    return 0


# --- the driver ------------------------------------------------------------------------------

def _environment(rank: int, port: int) -> dict[str, str]:
    # P2PCOLL_HEARTBEAT_TIMEOUT passes through: on a crowded machine a worker can be
    # starved for longer than the default 5 s, and the group then declares it lost.
    patience = {k: os.environ[k] for k in ("P2PCOLL_HEARTBEAT_TIMEOUT",) if k in os.environ}
    return peer_environment(f"tcp://{netns.address(0)}:{port}", WORLD, rank,
                            P2PCOLL_HOST_ID=f"host-{rank}", OMP_NUM_THREADS="1",
                            GLOO_SOCKET_IFNAME="eth0", P2PCOLL_JOIN_TIMEOUT="120",
                            **patience)


def run_mode(lab: netns.Lab, args: argparse.Namespace, mode: str, port: int,
             timeout: float) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """Run ``mode`` on every host of ``lab``: the workers' reports in rank order, and the
    bytes (sent, received) each host's cable carried meanwhile."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode,
            "--port", str(port), *args.passed]
    before = [lab.counters(r) for r in range(WORLD)]
    reports = run_to_end([lab.command(r, argv) for r in range(WORLD)],
                         [_environment(r, port) for r in range(WORLD)], timeout, cwd=ROOT)
    after = [lab.counters(r) for r in range(WORLD)]
    return reports, [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]


@dataclass
class Result:
    mode: str
    reports: list[dict[str, Any]] = field(default_factory=list)
    cables: list[tuple[int, int]] = field(default_factory=list)
    missing: str = ""  # why the mode did not run
    load: float = 0.0  # the machine's 1-minute load average when the mode ended

    def time_to(self, target: float) -> float | None:
        return next((t for t, _, acc in self.reports[0]["curve"] if acc >= target), None)


def _mb(n: float) -> str:
    return f"{n / 1e6:.3g}"


def table(results: list[Result], args: argparse.Namespace) -> str:
    steps = args.steps
    base = next((r for r in results if r.mode == "fp32" and r.reports), None)
    base_bytes = (sum(x["bytes_sent"] for x in base.reports) / WORLD) if base else None
    lines = [
        f"| mode | wall s | to {args.target:.0%} s | final acc | MB sent/worker (stats) "
        f"| KB/step (stats) | fewer bytes than fp32 | MB on the cable/worker | replicas "
        f"| inner steps / wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.missing:
            lines.append(f"| {r.mode} | not available: {r.missing} | | | | | | | | |")
            continue
        wall = max(x["wall"] for x in r.reports)
        reached = r.time_to(args.target)
        final = r.reports[0]["final"]
        sent = [x.get("bytes_sent") for x in r.reports]
        cable = sum(tx for tx, _ in r.cables) / WORLD
        equal = len({x["digest"] for x in r.reports}) == 1
        if None in sent:
            stats_cells = ["-", "-", "-"]
        else:
            mean = sum(sent) / WORLD
            ratio = f"{base_bytes / mean:.3g}x" if base_bytes and mean else "-"
            stats_cells = [_mb(mean), f"{mean / steps / 1e3:.4g}", ratio]
        to_target = "not reached" if reached is None else f"{reached:.1f}"
        util = utilisation(r)
        lines.append(
            f"| {r.mode} | {wall:.1f} | {to_target} | {final:.2%} | "
            f"{' | '.join(stats_cells)} | {_mb(cable)} | {'equal' if equal else 'DIFFER'} "
            f"| {'-' if util is None else f'{util:.1%}'} |")
    return "\n".join(lines)


# The targets at 100 Mbit/s, against synchronous fp32 training:
# (mode, fewer bytes per step at least, less time to the target at least, accuracy points
# lost at most); None: no target for that figure.
TARGETS = [("diloco", 400.0, 5.0, 1.0), ("diloco_h100", 400.0, 5.0, 1.0),
           ("int8_ef", 4.0, None, 0.5), ("diloco_topk2bit", 3000.0, None, 0.5)]


def utilisation(r: Result) -> float | None:
    """The mean over the workers of the time in inner steps over the wall time (the local
    modes, whose inner steps are timed), or None."""
    if not all(x.get("computing") for x in r.reports):
        return None
    return sum(x["computing"] / x["wall"] for x in r.reports) / len(r.reports)


def _before_flush(r: Result) -> float:
    """The utilisation up to the final flush: the time in inner steps over the wall time
    before the last round's exchange is waited for (a longer run's share)."""
    return sum(x["computing"] / (x["wall"] - x["finishing"]) for x in r.reports) / WORLD


def _other(x: dict[str, Any]) -> float:
    """A worker's wall time in neither inner steps, exchanges, the flush nor thread hops."""
    return x["wall"] - x["computing"] - x["stepping"] - x["finishing"] - x.get("hops", 0)


def targets(results: list[Result], args: argparse.Namespace) -> list[str]:
    """One line per target mode that ran: its figures against fp32's and the issue's."""
    by_mode = {r.mode: r for r in results if r.reports}
    lines = []
    sync, async_ = by_mode.get("diloco"), by_mode.get("diloco_async")
    if async_ is not None:
        util = utilisation(async_)
        parts = [f"{util:.1%} of the wall time in inner steps (issue: >= 98 %)"
                 if util is not None else "no utilisation"]
        if util is not None:  # the last round's exchange, which nothing can overlap
            flush = sum(x["finishing"] / x["wall"] for x in async_.reports) / WORLD
            parts.append(f"the final flush {flush:.1%} of it; without it "
                         f"{_before_flush(async_):.1%}")
        if sync is not None:
            gap = (async_.reports[0]["final"] - sync.reports[0]["final"]) * 100
            sync_util = utilisation(sync)
            parts.append(f"final accuracy {gap:+.2f} points against synchronous DiLoCo's "
                         f"(issue: within 0.5); synchronous DiLoCo: "
                         + (f"{sync_util:.1%} in inner steps" if sync_util else "-"))
        lines.append("- diloco_async: " + "; ".join(parts))
    base = by_mode.get("fp32")
    if base is None:
        return lines
    for mode, fewer, faster, points in TARGETS:
        r = by_mode.get(mode)
        if r is None:
            continue
        sent = sum(x["bytes_sent"] for x in r.reports)
        ratio = sum(x["bytes_sent"] for x in base.reports) / sent if sent else float("inf")
        parts = [f"{ratio:.0f}x fewer bytes per step (issue: >= {fewer:g}x)"]
        mine, theirs = r.time_to(args.target), base.time_to(args.target)
        if faster is not None:
            if mine is None or theirs is None:
                parts.append(f"time to {args.target:.0%}: {mine} against fp32's {theirs}")
            else:
                parts.append(f"{theirs / mine:.1f}x less time to {args.target:.0%} "
                             f"(issue: >= {faster:g}x)")
        lost = (base.reports[0]["final"] - r.reports[0]["final"]) * 100
        parts.append(f"final accuracy {-lost:+.2f} points (issue: no worse than "
                     f"-{points:g})")
        lines.append(f"- {mode} against fp32: " + "; ".join(parts))
    return lines


def plot(results: list[Result], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        if r.reports:
            curve = r.reports[0]["curve"]
            ax.plot([t for t, _, _ in curve], [a for _, _, a in curve], marker=".",
                    label=r.mode)
    ax.set_xlabel("wall time, s (evaluation left out)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", choices=sorted(LINKS), default="100mbit",
                        help="100mbit: 100 Mbit/s and 25 ms one way; 1gbit: 1 Gbit/s and 0.5 ms")
    parser.add_argument("--rate", help="each cable's rate each way, over --link's (tc)")
    parser.add_argument("--delay", help="one-way delay per cable, over --link's (0: none)")
    parser.add_argument("--burst", default=None, help="the token bucket's size (tc)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from {', '.join(MODES)} (all)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (300)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--widths", default="64,2048,1024,10", help="the MLP's layer widths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy (0.95)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--plot", default="slow_training.png", help="the plot's PNG path")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode")
    parser.add_argument("--scaling", default=None,
                        help="peer counts (4,8,16): bytes per round on memory groups instead")
    parser.add_argument("--hop-every-step", action="store_true",
                        help="the local modes hand each inner step to a thread and back, "
                             "instead of the steps between two exchanges at once")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.widths = [int(w) for w in str(args.widths).split(",")]
    if args.batch % WORLD:
        parser.error(f"--batch must be a multiple of {WORLD}")
    args.mode = args.worker
    # What the workers are given, so that they train exactly as asked.
    args.passed = ["--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
                   "--widths", ",".join(map(str, args.widths)), "--seed", str(args.seed),
                   "--eval-every", str(args.eval_every),
                   *(["--hop-every-step"] if args.hop_every_step else [])]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    if args.scaling is not None:
        print(asyncio.run(scaling(args, [int(p) for p in args.scaling.split(",")])))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        print(f"slow_training: unknown modes {unknown}; choose from {', '.join(MODES)}",
              file=sys.stderr)
        return 2
    reason = netns.unavailable()
    if reason is not None:
        print(f"slow_training: {reason}", file=sys.stderr)
        return 2
    rate, delay = LINKS[args.link]
    rate = args.rate or rate
    delay = args.delay if args.delay is not None else delay
    burst = args.burst or ("32kbit" if netns_rate_bits(rate) <= 200e6 else "512kbit")
    results = []
    started = time.monotonic()
    with netns.Lab(WORLD) as lab:
        how = lab.shape(rate, burst=burst, delay=None if delay in ("0", "0ms") else delay,
                        relay=True)
        for i, mode in enumerate(modes):
            try:
                MODES[mode](args)
            except NotAvailable as exc:
                results.append(Result(mode, missing=str(exc)))
                continue
            t = time.monotonic()
            reports, cables = run_mode(lab, args, mode, PORT + i, args.timeout)
            results.append(Result(mode, reports, cables, load=os.getloadavg()[0]))
            print(f"slow_training: {mode} took {time.monotonic() - t:.0f} s", file=sys.stderr)
    params = sum(a * b + b for a, b in pairwise(args.widths))
    title = (f"{WORLD} workers, {rate} and {delay} one way ({how}); MLP "
             f"{'-'.join(map(str, args.widths))} ({params / 1e6:.2f} M params), digits, "
             f"batch {args.batch}, {args.steps} steps")
    print(f"{title}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n")
    print(table(results, args))
    for r in results:
        # (messages_sent_lane counts TCP lanes too, which hosts of their own use)
        if r.reports and any(x.get("bytes_sent_shm") or x.get("links") != ["tcp"]
                             for x in r.reports):
            print(f"\nWARNING: {r.mode} used shared memory or ipc between hosts: "
                  f"{[(x.get('links'), x.get('bytes_sent_shm')) for x in r.reports]}")
    for r in results:
        if r.reports and all("stepping" in x for x in r.reports):
            print(f"\n{r.mode}: where the wall time went, per worker (s): " + "; ".join(
                f"wall {x['wall']:.1f}, inner steps {x['computing']:.1f}, exchanges on the "
                f"loop {x['stepping']:.2f}, final flush {x['finishing']:.2f}, thread hops "
                f"{x.get('hops', 0):.2f}, other {_other(x):.2f}"
                + (f", median inner step {1e3 * x['step_early']:.1f} ms in a round's first "
                   f"tenth (exchange in flight) against {1e3 * x['step_late']:.1f} ms"
                   if "step_early" in x else "")
                for x in r.reports))
    checks = targets(results, args)
    if checks:
        print("\nThe issue's targets (at 100 Mbit/s):\n" + "\n".join(checks))
    loads = [f"{r.mode} {r.load:.1f}" for r in results if r.reports]
    print(f"\nLoad average (1 min) of the machine as each mode ended ({os.cpu_count()} CPUs): "
          f"{', '.join(loads)}")
    plot(results, args.plot, title)
    print(f"\n(plot: {args.plot}; {time.monotonic() - started:.0f} s in all)")
    return 0


async def _bytes_per_round(world: int, shapes: list[tuple[int, ...]], rounds: int,
                           mode: str) -> float:
    """Mean bytes each rank sent per round (group.stats()) on ``world`` memory groups: one
    fp32 allreduce of the gradients (``mode="fp32"``), or one topk2bit DiLoCo exchange."""
    import numpy as np

    from p2pcoll import training
    from p2pcoll.testing import memory_groups

    groups = await memory_groups(world)

    async def rank(group: Any) -> int:
        start = np.random.default_rng(0)  # the same parameters on every rank
        params = {f"t{i}": start.standard_normal(s).astype(np.float32)
                  for i, s in enumerate(shapes)}
        rng = np.random.default_rng(group.rank + 1)
        diloco = training.DiLoCo(group, params, inner_steps=1, compressor="topk2bit",
                                 density=0.015)
        await group.barrier()
        before = group.stats()["bytes_sent"]
        for _ in range(rounds):
            for v in params.values():  # a pseudo-gradient of the rank's own
                v -= (0.01 * rng.standard_normal(v.shape)).astype(np.float32)
            if mode == "fp32":
                await training.allreduce_gradients(group, params, op="avg")
            else:
                await diloco.after_inner_step()
        return int(group.stats()["bytes_sent"] - before)

    try:
        sent = await asyncio.gather(*(rank(g) for g in groups))
    finally:
        for g in groups:
            await g.close()
    return sum(sent) / world / rounds


async def scaling(args: argparse.Namespace, worlds: list[int]) -> str:
    """How one round's bytes grow with the peers: fp32 allreduce against topk2bit."""
    import numpy as np

    shapes = [(b, a) if i % 2 == 0 else (b,) for a, b in pairwise(args.widths)
              for i in range(2)]
    n = sum(int(np.prod(s)) for s in shapes)
    lines = [f"Bytes per round per rank on memory groups, MLP {'-'.join(map(str, args.widths))}"
             f" ({n / 1e6:.2f} M float32 parameters), topk2bit density 1.5 %; "
             f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n",
             "| peers | fp32 allreduce KB/round | topk2bit KB/round | fewer bytes per round "
             "| with H = 50 |", "|---|---|---|---|---|"]
    for world in worlds:
        dense = await _bytes_per_round(world, shapes, 2, "fp32")
        sparse = await _bytes_per_round(world, shapes, 3, "topk2bit")
        lines.append(f"| {world} | {dense / 1e3:.0f} | {sparse / 1e3:.1f} | "
                     f"{dense / sparse:.0f}x | {50 * dense / sparse:.0f}x |")
    return "\n".join(lines)


def netns_rate_bits(rate: str) -> float:
    from slow_link import bits_per_second  # benchmarks/, beside this file

    return bits_per_second(rate)


if __name__ == "__main__":
    sys.exit(main())
