"""One rank of tests/test_torch_hooks.py: DDP with communication hooks, on one backend.

    python -m torch.distributed.run --nproc-per-node 2 tests/torch_hooks_worker.py \
        --backend p2pcoll|gloo --save DIR HOOK [HOOK ...]

For each HOOK (see :data:`HOOKS`) every rank builds the same model from the same seed,
wraps it in DistributedDataParallel with the hook registered, and trains it for
:data:`STEPS` steps on batches of its own (drawn from a generator seeded with the rank and
nothing else, so the same for every hook and backend). Then the ranks allgather their flat
parameters: the rank prints ``SAME <hook> <digest>`` if every rank holds the same bits
(``DIFFERENT <hook> ...`` otherwise), and rank 0 saves them to DIR/<hook>.pt for the test
to compare with the other backend's. A hook that raises prints ``RAISED <hook>
<class>: <message>`` and the worker goes on with the next. The last line is ``DONE``.

The rank, world size and rendezvous come from torchrun's environment.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
    quantization_hooks,
)
from torch.distributed.algorithms.model_averaging import averagers
from torch.nn.parallel import DistributedDataParallel

STEPS = 8
IN, HIDDEN, OUT, BATCH = 32, 48, 10, 16


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())


class Setup:
    """A hook's state and hook for one DDP model, and what to run after each step."""

    def __init__(self, state: Any, hook: Callable[..., Any],
                 after_step: Callable[[torch.nn.Module], None] | None = None) -> None:
        self.state, self.hook, self.after_step = state, hook, after_step


def powersgd_state() -> powerSGD_hook.PowerSGDState:
    # Rank 1 with error feedback and warm start; compression from the third step on, and
    # every tensor compressed (min_compression_rate=0: also the small ones).
    return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.0,
                                       use_error_feedback=True, warm_start=True,
                                       random_seed=0)


def post_local_sgd() -> Setup:
    """Global allreduce for 3 steps, then each rank alone (a subgroup of one rank per
    rank: local SGD), the parameters averaged every 2 steps from then on."""
    subgroup, _ = dist.new_subgroups(group_size=1)
    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                 start_localSGD_iter=3)
    averager = averagers.PeriodicModelAverager(period=2, warmup_steps=3)
    return Setup(state, post_localSGD_hook.post_localSGD_hook,
                 lambda model: averager.average_parameters(model.parameters()))


def p2pcoll_hook(codec: str, **kwargs: Any) -> Callable[[], Setup]:
    def make() -> Setup:
        from p2pcoll.torch import hooks

        state, hook = hooks.codec_hook(codec=codec, **kwargs)
        return Setup(state, hook)
    return make


def renamed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` under another name: DDP refuses hooks named ``bf16_compress_hook`` or
    ``bf16_compress_wrapper_hook`` unless torch was built with CUDA and NCCL (a check by
    name; the hook itself runs on any backend that sums bfloat16, Gloo as p2pcoll)."""
    def bf16_on_cpu(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads
        # the annotations, which this module's future import would make strings)
        return hook(state, bucket)
    return bf16_on_cpu


def quantization_hook(per_channel: bool) -> Callable[..., Any]:
    """torch's quantization_pertensor_hook / quantization_perchannel_hook with their one
    defect fixed: torch 2.13's index the allgather futures' values as if nested one level
    deeper (``fut.wait()[0]``), which raises IndexError on Gloo as on p2pcoll. The rest is
    theirs: scales and zero points allgathered, uint8 tensors allgathered inside a
    ``then`` callback, dequantised and averaged in rank order."""
    q = quantization_hooks

    def hook(process_group, bucket):  # type: ignore[no-untyped-def]  (as above)
        group = process_group if process_group is not None else dist.group.WORLD
        rank, size = group.rank(), group.size()
        tensor = bucket.buffer()
        channel = 512
        if per_channel:
            padded = torch.nn.functional.pad(tensor, (0, channel - len(tensor) % channel))
            source = padded.view(-1, channel)
            observer: Any = torch.ao.quantization.PerChannelMinMaxObserver()
            observer(source)
            s, z = observer.calculate_qparams()
            s_and_z = torch.stack((s, z)).to(torch.float32)
        else:
            source = tensor
            observer = torch.ao.quantization.MinMaxObserver()
            observer(source)
            s, z = observer.calculate_qparams()
            s_and_z = torch.tensor([float(s), float(z)])
        gathered = [torch.zeros_like(s_and_z) for _ in range(size)]
        fut = dist.all_gather(gathered, s_and_z, group=group, async_op=True).get_future()

        def quantize_and_allgather(fut: Any) -> Any:
            everyone = fut.wait()
            if per_channel:
                quantized = q._quantize_per_channel_backend(source, everyone[rank][0],
                                                            everyone[rank][1])
            else:
                quantized = q._quantize_per_tensor_backend(source, everyone[rank][0],
                                                           everyone[rank][1])
            out = [torch.zeros_like(quantized) for _ in range(size)]
            return [everyone, dist.all_gather(out, quantized, group=group,
                                              async_op=True).get_future().wait()]

        def dequantize_and_average(fut: Any) -> torch.Tensor:
            everyone, parts = fut.wait()
            total = torch.zeros(parts[0].shape, dtype=torch.float32)
            for r, part in enumerate(parts):
                if per_channel:
                    total += q._dequantize_per_channel_backend(part, everyone[r][0],
                                                               everyone[r][1])
                else:
                    total += q._dequantize_per_tensor_backend(part, everyone[r][0],
                                                              everyone[r][1])
            return total.flatten()[:len(tensor)] / size

        return fut.then(quantize_and_allgather).then(dequantize_and_average)
    return hook


HOOKS: dict[str, Callable[[], Setup]] = {
    "allreduce": lambda: Setup(None, default_hooks.allreduce_hook),
    "fp16": lambda: Setup(None, default_hooks.fp16_compress_hook),
    "bf16": lambda: Setup(None, renamed(default_hooks.bf16_compress_hook)),
    "powersgd": lambda: Setup(powersgd_state(), powerSGD_hook.powerSGD_hook),
    "batched_powersgd": lambda: Setup(powersgd_state(), powerSGD_hook.batched_powerSGD_hook),
    "fp16_powersgd": lambda: Setup(
        powersgd_state(), default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)),
    "bf16_powersgd": lambda: Setup(powersgd_state(), renamed(
        default_hooks.bf16_compress_wrapper(powerSGD_hook.powerSGD_hook))),
    "quantization_pertensor": lambda: Setup(
        None, quantization_hooks.quantization_pertensor_hook),
    "quantization_perchannel": lambda: Setup(
        None, quantization_hooks.quantization_perchannel_hook),
    "quantization_pertensor_fixed": lambda: Setup(None, quantization_hook(False)),
    "quantization_perchannel_fixed": lambda: Setup(None, quantization_hook(True)),
    "post_local_sgd": post_local_sgd,
    "p2pcoll_fp16": p2pcoll_hook("fp16"),
    "p2pcoll_bf16": p2pcoll_hook("bf16"),
    "p2pcoll_fp16_ef": p2pcoll_hook("fp16", error_feedback=True),
    "p2pcoll_bf16_ef": p2pcoll_hook("bf16", error_feedback=True),
    "p2pcoll_int8": p2pcoll_hook("int8"),
    "p2pcoll_int8_ef": p2pcoll_hook("int8", error_feedback=True),
}


# torch's hooks that start a collective inside a future's callback (and wait for it). On a
# CPU backend the callback runs on another thread than DDP's next bucket's hook, so with
# two buckets in flight the ranks may start their collectives in different orders: on
# Gloo the world hangs, on p2pcoll the group raises CollectiveMismatch. (On NCCL a
# callback runs when the work is queued, in the hook's own thread.) Their models get one
# bucket here.
NESTED = {"powersgd", "batched_powersgd", "fp16_powersgd", "bf16_powersgd",
          "quantization_pertensor", "quantization_perchannel", "quantization_pertensor_fixed",
          "quantization_perchannel_fixed"}


def traffic() -> dict[str, int] | None:
    """The default p2pcoll group's payload bytes sent so far, over sockets and shared
    memory (None on Gloo)."""
    pg = dist.group.WORLD
    group = getattr(pg, "group", None)
    if group is None:
        return None
    stats = pg._runtime._loop_thread.call(group.stats)  # type: ignore[union-attr]
    return {k: int(stats[k]) for k in ("bytes_sent", "bytes_sent_shm")}


def dying(setup: Setup, step: list[int], at: int) -> Setup:
    """``setup`` whose hook, on the last rank at step ``at``, exits the process after it
    has started its first bucket's collective of the step (a rank killed mid-step)."""
    hook, calls = setup.hook, [0]

    def killer(state, bucket):  # type: ignore[no-untyped-def]  (as above)
        if step[0] == at and dist.get_rank() == dist.get_world_size() - 1:
            calls[0] += 1
            if calls[0] == 2:
                os._exit(3)
        return hook(state, bucket)

    return Setup(setup.state, killer, setup.after_step)


def train(name: str, rank: int, kill_at: int | None = None) -> torch.Tensor:
    """The flat parameters after STEPS steps of DDP with hook ``name``."""
    setup = HOOKS[name]()
    step = [0]
    if kill_at is not None:
        setup = dying(setup, step, kill_at)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, OUT))
    # Small buckets: two per step from the second on (DDP rebuilds its buckets after the
    # first), so a hook runs more than once per backward; one for the hooks that start
    # collectives inside callbacks (see NESTED).
    ddp = DistributedDataParallel(model, bucket_cap_mb=25 if name in NESTED else 0.001)
    ddp.register_comm_hook(setup.state, setup.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)  # the same batches for every hook
    before = traffic()
    for step[0] in range(STEPS):
        x = torch.randn(BATCH, IN, generator=data)
        y = torch.randint(0, OUT, (BATCH,), generator=data)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if setup.after_step is not None:
            setup.after_step(ddp)
        say(f"STEP {name} {step[0]}")
    after = traffic()
    if after is not None and before is not None:
        say(f"BYTES {name} " + " ".join(f"{k}={after[k] - before[k]}" for k in after))
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    del ddp, opt, setup
    gc.collect()
    return flat


class Bucket:
    """What the codec hook reads of DDP's GradBucket: a flat buffer, an index, parameters."""

    def __init__(self, buffer: torch.Tensor, index: int = 0) -> None:
        self._buffer, self._index = buffer, index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return []


def direct() -> None:
    """p2pcoll's codec hook against ``reduce_coded`` on the group underneath, on the same
    data: the same averages, and with error feedback the same residuals, bit for bit
    (two rounds, so the second adds the first's residual). Prints ``DIRECT <codec> OK``
    or ``DIRECT <codec> FAIL <what>``."""
    from p2pcoll.codecs import reduce_coded
    from p2pcoll.torch import hooks

    rank = dist.get_rank()
    pg = hooks.p2pcoll_group()
    run = pg._runtime.run
    for codec in ("fp16", "bf16", "int8"):
        state, hook = hooks.codec_hook(codec, error_feedback=True)
        residual = np.zeros(3000, np.float32)
        wrong = []
        for round_no in range(2):
            gen = torch.Generator().manual_seed(10 * rank + round_no)
            grad = torch.randn(3000, generator=gen) * 1e-3
            mine = grad.numpy().copy()
            got = hook(state, Bucket(grad.clone())).wait()
            want = run(reduce_coded(pg.group, codec, [mine], "avg", residuals=[residual]))[0]
            if not torch.equal(got, torch.from_numpy(want)):
                wrong.append(f"average of round {round_no}")
            kept = state.residuals[(0, ())].numpy()
            if not np.array_equal(kept, residual):
                wrong.append(f"residual of round {round_no}")
        say(f"DIRECT {codec} " + (f"FAIL {', '.join(wrong)}" if wrong else "OK"))
    # NaN in one rank's bucket under int8: NonFiniteInput on every rank (as DDP would
    # raise it: torch's RuntimeError naming it, from the future's callback), and the next
    # bucket is averaged as usual.
    state, hook = hooks.codec_hook("int8")
    grad = torch.ones(2000)
    if rank == 0:
        grad[1500] = float("nan")
    try:
        hook(state, Bucket(grad)).wait()
        outcome = "FAIL no error"
    except RuntimeError as exc:
        outcome = "OK" if "NonFiniteInput: codec 'int8'" in str(exc) else f"FAIL {exc!r}"
    after = hook(state, Bucket(torch.full((2000,), float(rank)))).wait()
    if outcome == "OK" and not bool((after == (dist.get_world_size() - 1) / 2).all()):
        outcome = f"FAIL after: {after[:4]}"
    say(f"DIRECT nonfinite {outcome}")
    # A bucket of bfloat16 (a model in bfloat16) is refused before anything is sent.
    state, hook = hooks.codec_hook("int8")
    try:
        hook(state, Bucket(torch.zeros(8, dtype=torch.bfloat16)))
    except hooks.UnsupportedOperation as exc:
        say("DIRECT dtype " + ("OK" if "torch.bfloat16" in str(exc) else f"FAIL {exc}"))
    else:
        say("DIRECT dtype FAIL not refused")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--kill-at", type=int, help="the last rank dies in this step's "
                        "hook; the others print CAUGHT and the error, and exit 0")
    parser.add_argument("--direct", action="store_true", help="first run direct()")
    parser.add_argument("--own-hosts", action="store_true", help="each rank names a host "
                        "of its own (P2PCOLL_HOST_ID): sockets, no shared memory, so that "
                        "the group's stats() count every byte")
    parser.add_argument("hooks", nargs="+", choices=sorted(HOOKS))
    args = parser.parse_args()
    if args.own_hosts:
        os.environ["P2PCOLL_HOST_ID"] = f"host-{os.environ['RANK']}"
    if args.backend == "p2pcoll":
        import p2pcoll.torch  # noqa: F401  (registers the backend; the entry point does too)
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.direct:
        direct()
    if args.kill_at is not None:
        try:
            train(args.hooks[0], rank, args.kill_at)
        except RuntimeError as exc:
            say(f"CAUGHT {type(exc).__name__} | {' '.join(str(exc).split())[:3000]}")
            os._exit(0)  # the group is broken: nothing left to close
        say("NO ERROR")
        os._exit(1)
    for name in args.hooks:
        try:
            flat = train(name, rank)
        except Exception as exc:
            message = " ".join(str(exc).split())[:2000]
            say(f"RAISED {name} {type(exc).__name__}: {message}")
            traceback.print_exc(file=sys.stdout)
            dist.barrier()  # the ranks may have raised at different points: meet again
            continue
        everyone = [torch.zeros_like(flat) for _ in range(size)]
        dist.all_gather(everyone, flat)
        same = all(torch.equal(everyone[0], other) for other in everyone)
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        say(f"{'SAME' if same else 'DIFFERENT'} {name} {digest}")
        if rank == 0 and args.save is not None:
            torch.save(flat, args.save / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    say("DONE")


if __name__ == "__main__":
    main()
