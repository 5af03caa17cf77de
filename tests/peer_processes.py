"""Peer processes of one job for tests: started, their JSON report lines read, cleaned up.

Each worker prints JSON objects, one per line (``{"ready": {...}}``, ``{"after": {...}}``);
:meth:`PeerProcesses.wait_for` returns each rank's report under one key, or fails the test
naming the ranks that exited first (with the tail of their stderr) or never reported.
Used by tests/test_mesh_scale.py, tests/test_lazy_link_failures.py and
benchmarks/kill_loop.py.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from p2pcoll.testing import free_port

FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
FOREIGN_PREFIXES = ("P2PCOLL_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")


class PeerProcesses:
    """``n`` peers, rank r run as ``argv(r)`` with the job's rendezvous, ``WORLD_SIZE`` and
    ``RANK`` over a clean environment (no launcher's or p2pcoll's variables) plus
    ``env(r)``, each under a soft limit of ``nofile`` open files if given; the last ``tail``
    characters of each one's stderr are kept in ``errors``."""

    def __init__(self, n: int, argv: Callable[[int], list[str]],
                 env: Callable[[int], dict[str, str]] = lambda r: {},
                 nofile: int | None = None, tail: int = 2000) -> None:
        self.n, self._tail = n, tail
        port = free_port()
        base = {k: v for k, v in os.environ.items()
                if k not in FOREIGN and not k.startswith(FOREIGN_PREFIXES)}
        self.lines: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self.errors = ["" for _ in range(n)]

        def limit() -> None:
            if nofile is not None:
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

        self.procs = [subprocess.Popen(
            argv(r), env=dict(base, P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{port}",
                              WORLD_SIZE=str(n), RANK=str(r), **env(r)),
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
        """Each of ``ranks``' report under ``key``, in that order."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [next((x[key] for x in self.lines[r] if key in x), None) for r in ranks]
            if all(g is not None for g in got):
                return got  # type: ignore[return-value]
            for r, g in zip(ranks, got, strict=True):
                if g is None and self.procs[r].poll() is not None:
                    self.readers[r].join(timeout=10)  # the last lines, and stderr
                    if not any(key in x for x in self.lines[r]):
                        pytest.fail(f"rank {r} exited before {key!r}: {self.errors[r]}")
            time.sleep(0.05)
        missing = [r for r in ranks if not any(key in x for x in self.lines[r])]
        pytest.fail(f"ranks {missing} did not report {key!r} within {timeout} s")

    def close(self) -> None:
        """Wait for every process (killing those still there after a minute), then let go
        of the readers and the pipes."""
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        for t in self.readers:
            t.join(timeout=30)
        for proc in self.procs:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
