"""Peer processes of one job for tests and benchmarks: started, their JSON report lines
read, cleaned up.

Each worker prints JSON objects, one per line (``{"ready": {...}}``, ``{"after": {...}}``).
:class:`PeerProcesses` reads them while the peers run: :meth:`PeerProcesses.wait_for` returns
each rank's report under one key, or fails the test naming the ranks that exited first (with
the tail of their stderr) or never reported. :func:`run_to_end` is for peers that report
once, when they are done: it waits for them all (:func:`run_all`) and returns each one's
last line. Used by
tests/test_mesh_scale.py, tests/test_lazy_link_failures.py and others, and by
benchmarks/kill_loop.py, mesh_footprint.py and the benchmarks that run peers on the hosts of
a network-namespace lab (tests/netns.py).

Neither pytest nor p2pcoll is imported until used: a benchmark's workers import this module,
run with another checkout's p2pcoll (mesh_footprint.py ``--tree``) or without pytest.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

# What a launcher (torchrun, SLURM, Open MPI) or the caller's own job put in the environment:
# a peer started here gets none of it, only what its job gives it.
FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
FOREIGN_PREFIXES = ("P2PCOLL_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")


def clean_environment() -> dict[str, str]:
    """This process's environment without a launcher's or p2pcoll's variables."""
    return {k: v for k, v in os.environ.items()
            if k not in FOREIGN and not k.startswith(FOREIGN_PREFIXES)}


def peer_environment(rendezvous: str, world: int, rank: int, **variables: str
                     ) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world`` peers joining at ``rendezvous`` (a
    ``tcp://host:port`` URL), over :func:`clean_environment`, plus ``variables``."""
    return dict(clean_environment(), P2PCOLL_RENDEZVOUS=rendezvous, WORLD_SIZE=str(world),
                RANK=str(rank), **variables)


class PeerProcesses:
    """``n`` peers, rank r run as ``argv(r)`` (in ``cwd``, if given) with the job's
    rendezvous, ``WORLD_SIZE`` and ``RANK`` over a clean environment (no launcher's or
    p2pcoll's variables) plus ``env(r)``, each under a soft limit of ``nofile`` open files if
    given; the last ``tail`` characters of each one's stderr are kept in ``errors``."""

    def __init__(self, n: int, argv: Callable[[int], list[str]],
                 env: Callable[[int], dict[str, str]] = lambda r: {},
                 nofile: int | None = None, tail: int = 2000, cwd: str | None = None) -> None:
        from p2pcoll.testing import free_port

        self.n, self._tail = n, tail
        rendezvous = f"tcp://127.0.0.1:{free_port()}"
        self.lines: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self.errors = ["" for _ in range(n)]

        def limit() -> None:
            if nofile is not None:
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile, hard), hard))

        self.procs = [subprocess.Popen(
            argv(r), env=peer_environment(rendezvous, n, r, **env(r)), cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
            for r in range(n)]
        self.readers = [threading.Thread(target=self._read, args=(r,), daemon=True)
                        for r in range(n)]
        for t in self.readers:
            t.start()

    def _read(self, r: int) -> None:
        proc = self.procs[r]
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self.lines[r].append(json.loads(line))
        self.errors[r] = proc.stderr.read()[-self._tail:]

    def wait_for(self, key: str, ranks: list[int], timeout: float) -> list[dict[str, Any]]:
        """Each of ``ranks``' report under ``key``, in that order; :meth:`give_up` if one
        exits without it or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            got = [next((x[key] for x in self.lines[r] if key in x), None) for r in ranks]
            if all(g is not None for g in got):
                return got  # type: ignore[return-value]
            for r, g in zip(ranks, got, strict=True):
                if g is None and self.procs[r].poll() is not None:
                    self.readers[r].join(timeout=10)  # the last lines, and stderr
                    if not any(key in x for x in self.lines[r]):
                        self.give_up(f"rank {r} exited before {key!r}", self.errors[r])
            if time.monotonic() > deadline:
                missing = [r for r, g in zip(ranks, got, strict=True) if g is None]
                self.give_up(f"ranks {missing[:8]} did not report {key!r} in {timeout} s")
            time.sleep(0.05)

    def give_up(self, why: str, stderr: str | None = None) -> NoReturn:
        """How :meth:`wait_for` ends when a rank will not report: fail the test with ``why``
        and the rank's ``stderr`` (if it exited). A benchmark overrides it to raise."""
        import pytest

        pytest.fail(why if stderr is None else f"{why}: {stderr}")

    def close(self) -> None:
        """Wait for every process (killing those still there after a minute), then let go
        of the readers and the pipes."""
        deadline = time.monotonic() + 60
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        for t in self.readers:
            t.join(timeout=30)
        for proc in self.procs:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def run_all(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
            timeout: float, *, cwd: str | Path | None = None, stdin: str | None = None
            ) -> list[subprocess.CompletedProcess[str]]:
    """Run rank r as ``commands[r]`` with the environment ``envs[r]``, all at once, until
    every one has exited; returns what each did (exit status, stdout, stderr) in rank
    order. ``stdin``: the text each one reads on its stdin (None: nothing, at once its end).
    Those still running when it raises are killed.

    Raises:
        RuntimeError: a rank was still running ``timeout`` seconds after the start.
    """
    procs = [subprocess.Popen(command, env=env, cwd=cwd, text=True,
                              stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for command, env in zip(commands, envs, strict=True)]
    deadline = time.monotonic() + timeout
    done = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(stdin, max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"rank {rank} still running after {timeout:g}s") from None
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def run_to_end(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
               timeout: float, *, cwd: str | Path | None = None, name: str = ""
               ) -> list[dict[str, Any]]:
    """Run the ranks as :func:`run_all` does (nothing on their stdin) and return each one's
    report, the last line of its stdout as JSON, in rank order.

    Raises:
        RuntimeError: a rank (of the ``name`` workers, if given) was still running at the
            timeout, or ranks exited with an error (each one's stderr's tail in the message).
    """
    who = f"{name} " if name else ""
    try:
        done = run_all(commands, envs, timeout, cwd=cwd)
    except RuntimeError as exc:
        raise RuntimeError(f"{who}{exc}") from None
    failed = [(rank, proc) for rank, proc in enumerate(done) if proc.returncode != 0]
    if failed:
        raise RuntimeError("\n".join(f"{who}rank {rank} exited with {proc.returncode}:\n"
                                     f"{proc.stderr[-3000:]}" for rank, proc in failed))
    return [json.loads(proc.stdout.strip().splitlines()[-1]) for proc in done]


def port_held(port: int) -> bool:
    """Whether something listens on ``port`` of 127.0.0.1 (a rendezvous' host, say): binding
    it fails then. Nothing connects to it, so the listener sees no stranger."""
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


READY = 'print("ready", flush=True); sys.stdin.readline()'  # a worker's line before it joins


def start_together(procs: Sequence[subprocess.Popen[str]], go: bool = True) -> None:
    """Once each of ``procs`` (text pipes on stdin and stdout) has printed ``ready``, its
    imports done (:data:`READY`), tell them all to go on (with ``go=False``, the caller does:
    :func:`go_on`). The peers of an elastic job whose interpreters start seconds apart under
    load would form a smaller group first (one second without arrivals settles it)."""
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line == "ready\n", (line, p.args)
    if go:
        go_on(procs)


def go_on(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Let workers that printed ``ready`` (:data:`READY`) go on."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
