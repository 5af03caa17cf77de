"""DDP communication hooks on the "p2pcoll" backend, against Gloo (issue 24, torch).

Two worlds of ``tests/torch_hooks_worker.py`` under torchrun, one per backend, train the
same model on the same batches with each hook (torch's own, and p2pcoll's codec hooks
from ``p2pcoll.torch.hooks``); the tests compare the final parameters across ranks (the
worker allgathers them) and across backends (rank 0 saves them), bit for bit. That at 2
ranks on one host (p2pcoll's small collectives on its shared-memory board, as by
default), and again at 3 ranks on hosts of their own (``P2PCOLL_HOST_ID``: sockets only,
so the group's ``stats()`` counts every byte; and at 3 ranks the order of a sum's terms
decides its last bits).

torch 2.13's ``batched_powerSGD_hook`` and quantization hooks raise on every backend (see
:data:`BROKEN_IN_TORCH`): for those the tests assert that p2pcoll raises what Gloo raises,
and the quantization hooks run once more with their indexing fixed
(``quantization_*_fixed`` in the worker), to compare what they compute.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import finish

from p2pcoll.testing import free_port

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

WORKER = Path(__file__).with_name("torch_hooks_worker.py")
# (ranks, how p2pcoll's ranks talk): "board" one host, "sockets" a host each.
WORLDS = [(2, "board"), (3, "sockets")]
# torch's hooks that run on CPU, with the bits Gloo gives (the worker's names).
TORCH_HOOKS = ["allreduce", "fp16", "bf16", "powersgd", "fp16_powersgd", "bf16_powersgd",
               "quantization_pertensor_fixed", "quantization_perchannel_fixed",
               "post_local_sgd"]
# torch's hooks that raise on Gloo too, in torch 2.13: batched PowerSGD hands a 2-D matrix
# to _orthogonalize, which wants a batch (AssertionError); the quantization hooks read the
# allgather futures' values one level too deep (IndexError).
BROKEN_IN_TORCH = ["batched_powersgd", "quantization_pertensor", "quantization_perchannel"]
# p2pcoll's codec hooks (p2pcoll.torch.hooks.codec_hook) in the worker.
CODECS = ["fp16", "bf16", "int8"]
CODEC_HOOKS = [f"p2pcoll_{c}{ef}" for c in CODECS for ef in ("", "_ef")]
WORLD_TIMEOUT = 600.0  # seconds for a world (2 cores shared with other test runs)


@dataclass
class Run:
    """What one backend's world did: exit code, output, and per hook what every rank said."""

    size: int
    code: int
    output: str
    said: dict[str, list[str]]  # hook -> one line per rank ("SAME <digest>", "RAISED ...")
    saved: Path

    def params(self, hook: str) -> torch.Tensor:
        return torch.load(self.saved / f"{hook}.pt", weights_only=True)


def run_world(backend: str, size: int, path: str, hooks: list[str], saved: Path) -> Run:
    saved.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("P2PCOLL_ALLREDUCE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(size),
         "--master-port", str(free_port()), str(WORKER), "--backend", backend,
         "--save", str(saved), *(["--direct"] if backend == "p2pcoll" else []),
         *(["--own-hosts"] if backend == "p2pcoll" and path == "sockets" else []), *hooks],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    [(code, output)] = finish([proc], WORLD_TIMEOUT)
    said: dict[str, list[str]] = {}
    for m in re.finditer(r"^(SAME|DIFFERENT|RAISED|BYTES) (\w+) ?(.*)$", output, re.M):
        said.setdefault(m.group(2), []).append(f"{m.group(1)} {m.group(3)}")
    return Run(size, code, output, said, saved)


_pairs: dict[tuple[int, str], dict[str, Run]] = {}  # each pair of worlds runs once


def pair(size: int, path: str, tmp: pytest.TempPathFactory) -> dict[str, Run]:
    """The Gloo and p2pcoll worlds of ``size`` ranks (run both at once, the first time)."""
    if (size, path) not in _pairs:
        hooks = TORCH_HOOKS + BROKEN_IN_TORCH + CODEC_HOOKS
        with ThreadPoolExecutor(2) as pool:
            futures = {b: pool.submit(run_world, b, size, path, hooks,
                                      tmp.mktemp(f"{b}-{size}-{path}"))
                       for b in ("gloo", "p2pcoll")}
            _pairs[size, path] = {b: f.result(WORLD_TIMEOUT + 60) for b, f in futures.items()}
    return _pairs[size, path]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{n}ranks-{p}" for n, p in WORLDS])
def runs(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return pair(*request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def socket_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return pair(3, "sockets", tmp_path_factory)


def same_on_every_rank(run: Run, hook: str) -> str:
    """The digest every rank reported for ``hook`` (failing the test unless all agree)."""
    lines = [line for line in run.said.get(hook, []) if not line.startswith("BYTES ")]
    assert run.code == 0 and len(lines) == run.size, f"{hook}: {lines}\n{run.output[-4000:]}"
    assert all(line.startswith("SAME ") for line in lines), f"{hook}: {lines}"
    assert len(set(lines)) == 1, f"{hook}: the ranks' digests differ: {lines}"
    return lines[0].split()[1]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("hook", TORCH_HOOKS)
def test_torchs_hook_gives_gloos_bits(runs: dict[str, Run], hook: str) -> None:
    # fp16/bf16 compression, PowerSGD (rank 1, error feedback, warm start) alone and under
    # the fp16/bf16 wrappers, quantization (allgathers of uint8 inside then-callbacks),
    # post-local SGD (a subgroup of one rank per rank from new_subgroups, and
    # PeriodicModelAverager's allreduce of the parameters).
    gloo, p2p = same_on_every_rank(runs["gloo"], hook), same_on_every_rank(runs["p2pcoll"], hook)
    assert torch.equal(runs["p2pcoll"].params(hook), runs["gloo"].params(hook)), (
        f"{hook}: p2pcoll {p2p}, gloo {gloo}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("hook", BROKEN_IN_TORCH)
def test_torchs_broken_hook_fails_as_on_gloo(runs: dict[str, Run], hook: str) -> None:
    # batched_powerSGD_hook first resizes the bucket's buffer, which p2pcoll's collectives
    # must leave resizable as Gloo does; then both fail in torch's own code alike.
    for backend, run in runs.items():
        lines = run.said.get(hook, [])
        assert len(lines) == run.size and all(line.startswith("RAISED ") for line in lines), (
            f"{backend} {hook}: {lines}")
    # Every rank's message (without the traceback's frames), as a multiset: at 3 ranks
    # the last rank's differs from the others' (an index out of bounds), on both backends.
    gloo, p2p = (sorted(line.split(" At: ")[0] for line in runs[b].said[hook])
                 for b in ("gloo", "p2pcoll"))
    assert p2p == gloo


@pytest.mark.timeout(900)
@pytest.mark.parametrize("codec", [*CODECS, "nonfinite", "dtype"])
def test_codec_hook_averages_as_the_group_does(runs: dict[str, Run], codec: str) -> None:
    # The hook on a bucket against p2pcoll.codecs.reduce_coded(group, codec, [x], "avg",
    # residuals=[r]) on the same data, two rounds with error feedback: the same averages
    # and the same residuals, bit for bit, on every rank. ("nonfinite": NaN in rank 0's
    # bucket under int8 is an error naming NonFiniteInput on every rank, and the next
    # bucket is averaged; "dtype": a bfloat16 bucket is refused, naming its dtype.)
    lines = re.findall(rf"^DIRECT {codec} (.*)$", runs["p2pcoll"].output, re.M)
    assert lines == ["OK"] * runs["p2pcoll"].size, lines or runs["p2pcoll"].output[-4000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("codec", CODECS)
def test_codec_hook_keeps_replicas_identical(runs: dict[str, Run], codec: str) -> None:
    p2p = runs["p2pcoll"]
    plain, feedback = f"p2pcoll_{codec}", f"p2pcoll_{codec}_ef"
    for hook in (plain, feedback):
        same_on_every_rank(p2p, hook)
        # On a Gloo process group the hook is refused, naming the backend.
        [line, *_] = runs["gloo"].said[hook]
        assert line.startswith("RAISED UnsupportedOperation") and "'gloo'" in line, line
    exact = p2p.params("allreduce")  # fp32 DDP, the same batches
    lossy, corrected = p2p.params(plain), p2p.params(feedback)
    assert not torch.equal(lossy, exact) and not torch.equal(corrected, lossy)
    assert float((lossy - exact).abs().max()) < 2e-3  # an average, not a sum
    # Error feedback brings training closer to fp32's (a fixed run: deterministic).
    assert float((corrected - exact).abs().mean()) < float((lossy - exact).abs().mean())
    if codec == "bf16" and p2p.size == 2:
        # At 2 ranks p2pcoll's bf16 average (x / 2 in float32, then rounded) and torch's
        # bf16_compress_hook (rounded, then / 2) are the same bits: halving is exact in
        # bfloat16's range. (fp16's subnormals make its halving inexact, so torch's fp16
        # hook and p2pcoll's differ in the last bits of the smallest gradients.)
        assert torch.equal(lossy, runs["gloo"].params("bf16"))


def sent(run: Run, hook: str) -> list[int]:
    """Payload bytes each rank sent while training with ``hook`` (the group's stats())."""
    lines = [line for line in run.said.get(hook, []) if line.startswith("BYTES ")]
    assert len(lines) == run.size, lines
    counts = [dict(kv.split("=") for kv in line.split()[1:]) for line in lines]
    assert all(int(c["bytes_sent_shm"]) == 0 for c in counts), counts  # own hosts: sockets
    return [int(c["bytes_sent"]) for c in counts]


@pytest.mark.timeout(900)
def test_codec_hooks_send_the_codecs_bytes(socket_runs: dict[str, Run]) -> None:
    # The same 8 steps: fp16 and bf16 half the bytes of fp32 DDP, int8 a quarter plus its
    # scales (4 bytes per block of 1024; the buckets here are 490 and 1584 elements).
    p2p = socket_runs["p2pcoll"]
    fp32 = sent(p2p, "allreduce")
    for hook, ratio in (("p2pcoll_fp16", 2), ("p2pcoll_bf16", 2), ("p2pcoll_int8", 4),
                        ("p2pcoll_int8_ef", 4)):
        for full, coded in zip(fp32, sent(p2p, hook), strict=True):
            # (within 2 %: the ring splits odd lengths into chunks of unequal sizes)
            assert 0.98 <= coded * ratio / full <= 1.02, (hook, full, coded)


@pytest.mark.timeout(600)
def test_codec_hook_survivor_of_a_killed_rank_gets_the_error() -> None:
    # Rank 1 dies in its hook of step 3, after its first bucket's collective started (not
    # under torchrun, whose agent would stop the survivor itself): rank 0's backward()
    # raises torch's RuntimeError naming p2pcoll's PeerLost and rank 1, and exits 0.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "P2PCOLL_HEARTBEAT_TIMEOUT": "15"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--backend", "p2pcoll",
                               "--kill-at", "3", "p2pcoll_fp16_ef"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    (code, out), (victim_code, victim_out) = finish(procs, 300)
    assert victim_code == 3, victim_out[-3000:]
    assert code == 0, out[-3000:]
    assert "STEP p2pcoll_fp16_ef 2" in out and "STEP p2pcoll_fp16_ef 3" not in out, out
    assert re.search(r"^CAUGHT RuntimeError \| .*PeerLost: .*rank 1\b", out, re.M), out[-3000:]


def test_codec_hook_bad_arguments_name_what_is_wrong() -> None:
    from p2pcoll.codecs import UnknownCodec
    from p2pcoll.torch import hooks

    with pytest.raises(TypeError, match="codec must be"):
        hooks.codec_hook(codec=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        hooks.codec_hook("fp16", error_feedback="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be positive"):
        hooks.codec_hook("fp16", timeout=0)
    with pytest.raises(UnknownCodec, match="'int3'.*int8"):
        hooks.codec_hook("int3")
    with pytest.raises(ValueError, match="init_process_group"):
        hooks.codec_hook("fp16")  # no process group in this process
