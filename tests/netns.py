"""Hosts of their own on one machine: network namespaces joined by a switch.

Used by ``tests/test_netns.py`` and ``benchmarks/slow_link.py``; needs root and ``ip``
(iproute2), and nothing from p2pcoll. A :class:`Lab` of N hosts is N + 1 namespaces:

    p2pcoll-lab-<pid>-<n>-sw   the switch: bridge br0 with ports p0 .. p(N-1)
    p2pcoll-lab-<pid>-<n>-hR   host R: lo, and eth0 (the far end of port pR) at 198.18.0.(R+1)/24

Nothing is made or changed in the namespace the lab is made from (the machine's own
network): each veth pair is created inside the switch namespace, its far end moved straight
into its host's namespace, and 198.18.0.0/15 (RFC 2544's benchmarking range) appears only
inside the lab. Every namespace of a lab has a route to the others and to nothing else.

:meth:`Lab.close` kills what still runs inside the lab's namespaces (by pid, from
``ip netns pids``) and deletes them, which deletes their links with them; it never raises,
so a test's ``finally`` may call it whatever failed. A lab whose maker was killed before it
could close is removed by the next :func:`sweep` (the ``<pid>`` in its names is gone).

Processes started with :meth:`Lab.command` share the machine's file system, hostname and
kernel boot id: to p2pcoll they are on one host (``auto`` reaches them over ipc and shared
memory, which cross network namespaces), only their network stacks differ.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Self

PREFIX = "p2pcoll-lab-"
_NAME = re.compile(re.escape(PREFIX) + r"([1-9][0-9]*)-([0-9]+)-(sw|h[0-9]+)")
_serial = itertools.count()


def address(rank: int, subnet: int = 0) -> str:
    """Host ``rank``'s address in the lab (``subnet`` 0: eth0's own; 1: the alternative)."""
    return f"198.18.{subnet}.{rank + 1}"


class LabError(RuntimeError):
    """An ``ip`` or ``tc`` command of the lab failed (its command line and stderr)."""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why this process cannot make a lab (not root, no ``ip``), or None if it may try."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _namespaces() -> list[str]:
    try:
        out = _run("ip", "netns", "list")
    except LabError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _kill_inside(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` (each by its pid) and wait until none is left."""
    for _ in range(50):
        try:
            pids = [int(p) for p in _run("ip", "netns", "pids", namespace).split()]
        except LabError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    try:
        _run("ip", "netns", "delete", namespace)
    except LabError:
        pass


def sweep() -> list[str]:
    """Delete the namespaces of labs whose maker has exited without closing them; returns
    their names. A live maker's lab (another test or benchmark running now) is left alone."""
    removed = []
    for name in _namespaces():
        match = _NAME.fullmatch(name)
        if match is not None and _gone(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


class Lab:
    """``hosts`` namespaces on one switch; see the module docstring.

    Use as a context manager, or call :meth:`close` in a ``finally``.
    """

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        tag = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{r}" for r in range(hosts)]
        self._made: list[str] = []

    def __enter__(self) -> Self:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Make the namespaces and links; raises :class:`LabError` if one cannot be made."""
        sweep()
        sw = self.switch
        for name in (sw, *self.names):
            _run("ip", "netns", "add", name)
            self._made.append(name)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for r, host in enumerate(self.names):
            port = f"p{r}"
            _run("ip", "-n", sw, "link", "add", port, "type", "veth",
                 "peer", "name", "eth0", "netns", host)
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
            _run("ip", "-n", host, "link", "set", "lo", "up")
            _run("ip", "-n", host, "address", "add", f"{address(r)}/24", "dev", "eth0")
            _run("ip", "-n", host, "link", "set", "eth0", "up")

    def close(self) -> None:
        """Kill what runs in the lab and delete its namespaces (never raises)."""
        for name in reversed(self._made):
            _delete(name)
        self._made.clear()

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``rank`` (as ``ip netns exec``, which
        execs it: the pid of the started process is that of ``argv``)."""
        return ["ip", "netns", "exec", self.names[rank], *argv]

    def add_address(self, rank: int, subnet: int) -> str:
        """Give host ``rank``'s eth0 a second address, ``address(rank, subnet)``/24."""
        extra = address(rank, subnet)
        _run("ip", "-n", self.names[rank], "address", "add", f"{extra}/24", "dev", "eth0")
        return extra

    def cut(self, rank: int) -> None:
        """Pull host ``rank``'s cable: its eth0 goes down (its port on the switch loses
        carrier); nothing it sends or is sent arrives any more."""
        _run("ip", "-n", self.names[rank], "link", "set", "eth0", "down")

    def counters(self, rank: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by host ``rank``'s eth0."""
        stats = json.loads(_run("ip", "-n", self.names[rank], "-json", "-statistics",
                                "link", "show", "eth0"))[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def drops(self) -> int:
        """Packets the queueing disciplines of the lab's cables have dropped so far (a full
        token bucket's queue drops, and TCP sends again)."""
        total = 0
        for namespace, device in [*((h, "eth0") for h in self.names),
                                  *((self.switch, f"p{r}") for r in range(self.hosts))]:
            shown = _run("tc", "-n", namespace, "-statistics", "-json", "qdisc", "show",
                         "dev", device)
            total += sum(int(q.get("drops", 0)) for q in json.loads(shown or "[]"))
        return total

    def shape(self, rate: str, burst: str = "32kbit", latency: str = "50ms",
              delay: str | None = None) -> None:
        """Every cable to ``rate`` each way: a token bucket (``tc ... tbf``) on both ends of
        it (host R's eth0 sends, switch port pR delivers to R), so a host sends at ``rate``
        and receives at ``rate`` in all, from however many senders.

        ``delay`` (a ``tc`` time, e.g. ``5ms``) adds that one-way delay to what each host
        sends (``netem``, with the token bucket under it), so a round trip between two
        hosts takes twice ``delay``. Raises :class:`LabError` where the kernel has no netem.
        """
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        for r, host in enumerate(self.names):
            _run("tc", "-n", self.switch, "qdisc", "add", "dev", f"p{r}", "root", *tbf)
            if delay is None:
                _run("tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", *tbf)
                continue
            try:
                _run("tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", "handle", "1:",
                     "netem", "delay", delay)
            except LabError as exc:
                raise LabError(f"{exc} (a delay needs the kernel's netem qdisc, "
                               f"CONFIG_NET_SCH_NETEM)") from None
            _run("tc", "-n", host, "qdisc", "add", "dev", "eth0", "parent", "1:1",
                 "handle", "10:", *tbf)
