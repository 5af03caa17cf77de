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
memory, which cross network namespaces), only their network stacks differ; give each its
own ``P2PCOLL_HOST_ID`` to make them separate hosts.

Delay. :meth:`Lab.shape` delays what each host sends with the kernel's netem. Where the
kernel has no netem (``CONFIG_NET_SCH_NETEM`` unset), :meth:`Namespaces.delay_packets`
does it in the switch: an iptables rule (FORWARD, NFQUEUE, no bypass) hands every IPv4
packet crossing the switch to a small C program (``nfq_delay.c``, built with this machine's
C compiler by ``netns_delay.py``), which sees only each packet's id and arrival stamp and
lets the kernel forward it ``delay`` after it arrived. Each packet crosses the switch once,
so a round trip between two hosts takes ``2 * delay`` more, and TCP on the hosts sees that
round trip: windows, slow start and striped links feel the delay as over a long cable. The
token buckets stay on the cables' ends (``tc tbf``). What differs from netem: packets that
are not IPv4 (ARP) are not delayed, and a release is late by the delayer's wake-up (tens of
microseconds; it asks for real-time scheduling so a busy machine does not add to that).
Measured (``benchmarks/lab_delay.py``, 1 Gbit/s, 50 ms): round trips of 100.3-100.4 ms, one
TCP stream at its window / RTT within 2 % from 32 Mbit/s to the line rate, the delayer at
about 13 % of a core for a stream at line rate. Its cost is per packet: a token bucket whose
``burst`` holds a 64 KiB GSO packet passes it whole (one packet for the delayer, not 45).

Where the delayer cannot run either (no C compiler, iptables or the kernel's nfnetlink
queue), :meth:`Namespaces.delay_streams` delays one level up: an nftables rule in each host
redirects the TCP connections it opens to other hosts of the lab to a relay in that host
(this file run as ``python netns.py relay``), which connects on to the real destination and
holds every byte ``delay`` each way before passing it on. Each connection crosses exactly
one relay (its opener's), so a message and its answer take ``2 * delay`` more, and the
cable's token bucket still sets the rate. But the two TCP connections on either side of the
relay see a short round trip, so their windows and slow start do not feel the delay, the
relay (Python) binds long before 1 Gbit/s, and only TCP is delayed: a stand-in for latency,
not for a long fat pipe.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Self

import netns_delay  # beside this file (tests/ is on the path of whoever imports this one)

PREFIX = "p2pcoll-lab-"
RELAY_PORT = 15001  # in each host's own namespace, on 127.0.0.1
RELAY_MARK = 0x1D  # the relay's own connections carry it, so its rule passes them by
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h: where a redirected connection was going
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


class Namespaces:
    """What every lab of namespaces shares: the names of its hosts' namespaces (and its
    switch's), the context manager, :meth:`command`, :meth:`delay_streams` and
    :meth:`close`; subclasses make them in :meth:`create`."""

    prefix = PREFIX  # of its namespaces' names (what its module's sweep() removes)

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        self.tag = f"{self.prefix}{os.getpid()}-{next(_serial)}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{r}" for r in range(hosts)]
        self._made: list[str] = []
        self._relays: list[subprocess.Popen[str]] = []
        self.delayer: subprocess.Popen[str] | None = None  # delay_packets' process

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
        raise NotImplementedError

    def close(self) -> None:
        """Kill what runs in the lab and delete its namespaces (never raises)."""
        for name in reversed(self._made):
            _delete(name)
        self._made.clear()
        helpers = [*self._relays, *([self.delayer] if self.delayer is not None else [])]
        for helper in helpers:  # killed with their namespace: reap them
            with contextlib.suppress(Exception):
                helper.kill()
                helper.wait(timeout=5)
            for pipe in (helper.stdout, helper.stderr):
                if pipe is not None:
                    pipe.close()
        self._relays.clear()
        self.delayer = None


    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``rank`` (as ``ip netns exec``, which
        execs it: the pid of the started process is that of ``argv``)."""
        return ["ip", "netns", "exec", self.names[rank], *argv]

    def delay_packets(self, delay: float) -> None:
        """Delay every IPv4 packet crossing the switch by ``delay`` seconds, in the kernel's
        path (a netfilter queue and the lab's packet delayer: see the module docstring);
        :attr:`delayer` is its process (to read its CPU time).

        Raises:
            LabError: the delayer cannot run here (no compiler or ``iptables``, the kernel
                refused the queue or the rule: the reason), or it runs already.
        """
        if self.delayer is not None:
            raise LabError(f"{self.switch} has its packet delayer already")
        reason = netns_delay.unavailable()
        if reason is not None:
            raise LabError(reason)
        try:
            self.delayer = netns_delay.start(self.switch, delay)
        except netns_delay.DelayError as exc:
            raise LabError(str(exc)) from None

    def delay_streams(self, delay: float, limit: int = 4 << 20) -> None:
        """Delay every TCP stream between hosts of the lab by ``delay`` seconds each way,
        with a relay in each host (see the module docstring). ``limit``: the bytes a relay
        holds per direction of a connection before it stops reading from the sender.

        Raises:
            LabError: ``nft`` is missing or refused the rule, or a relay did not start.
        """
        if shutil.which("nft") is None:
            raise LabError("`nft` (nftables) is not installed: apt-get install -y nftables")
        rule = "\n".join([
            "table ip p2pcoll_lab {",
            "  chain output {",
            "    type nat hook output priority -100; policy accept;",
            f"    meta l4proto tcp ip daddr 198.18.0.0/15 fib daddr type != local "
            f"meta mark != {RELAY_MARK} redirect to :{RELAY_PORT}",
            "  }",
            "}",
            ""])
        for host in self.names:
            relay = subprocess.Popen(
                ["ip", "netns", "exec", host, sys.executable, os.path.abspath(__file__),
                 "relay", "--delay", repr(delay), "--limit", str(limit)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
            self._relays.append(relay)
            assert relay.stdout is not None
            if relay.stdout.readline().strip() != "ready":
                raise LabError(f"the delay relay of {host} did not start "
                               f"(exit status {relay.poll()})")
            done = subprocess.run(["ip", "netns", "exec", host, "nft", "-f", "-"], input=rule,
                                  capture_output=True, text=True, check=False, timeout=30)
            if done.returncode != 0:
                raise LabError(f"nft in {host} refused the relay's rule: {done.stderr.strip()}")


class Lab(Namespaces):
    """``hosts`` namespaces on one switch; see the module docstring.

    Use as a context manager, or call :meth:`close` in a ``finally``.
    """

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
        """Packets the queueing disciplines of the lab's cables (and the packet delayer's
        queue, if it runs) have dropped so far (a full queue drops, and TCP sends again)."""
        total = netns_delay.dropped(self.switch) if self.delayer is not None else 0
        for namespace, device in [*((h, "eth0") for h in self.names),
                                  *((self.switch, f"p{r}") for r in range(self.hosts))]:
            shown = _run("tc", "-n", namespace, "-statistics", "-json", "qdisc", "show",
                         "dev", device)
            total += sum(int(q.get("drops", 0)) for q in json.loads(shown or "[]"))
        return total

    def shape(self, rate: str, burst: str = "32kbit", latency: str = "50ms",
              delay: str | None = None, *, relay: bool = False) -> str:
        """Every cable to ``rate`` each way: a token bucket (``tc ... tbf``) on both ends of
        it (host R's eth0 sends, switch port pR delivers to R), so a host sends at ``rate``
        and receives at ``rate`` in all, from however many senders.

        ``delay`` (a ``tc`` time, e.g. ``5ms``) adds that one-way delay to every packet
        between two hosts, so a round trip takes twice ``delay``: the kernel's ``netem`` on
        what each host sends (the token bucket under it), or where the kernel has none the
        packet delayer in the switch (:meth:`delay_packets`); where that cannot run either,
        ``relay`` delays the TCP streams instead (:meth:`delay_streams`: latency only, see
        the module docstring), and without it :class:`LabError` is raised naming both
        reasons. Returns how the delay is made: ``"netem"``, ``"nfqueue"``, ``"relay"`` or
        ``""`` (none asked for).

        A token bucket passes a GSO packet (up to 64 KiB) whole only if ``burst`` holds it;
        with a smaller one it cuts it into frames, each a packet for the delayer to handle.
        """
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        netem, no_netem = delay is not None, ""
        for r, host in enumerate(self.names):
            _run("tc", "-n", self.switch, "qdisc", "add", "dev", f"p{r}", "root", *tbf)
            if not netem:
                _run("tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", *tbf)
                continue
            try:
                _run("tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", "handle", "1:",
                     "netem", "delay", str(delay))
            except LabError as exc:
                if r > 0:
                    raise
                no_netem = f"{exc} (no netem qdisc, CONFIG_NET_SCH_NETEM)"
                netem = False
                _run("tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", *tbf)
                continue
            _run("tc", "-n", host, "qdisc", "add", "dev", "eth0", "parent", "1:1",
                 "handle", "10:", *tbf)
        if delay is None:
            return ""
        if netem:
            return "netem"
        try:
            self.delay_packets(seconds(delay))
            return "nfqueue"
        except LabError as exc:
            if not relay:
                raise LabError(f"{no_netem}; the packet delayer: {exc}") from None
        self.delay_streams(seconds(delay))
        return "relay"

    def limit_pair(self, a: int, b: int, rate: str, link_rate: str) -> None:
        """Slow the pair of hosts ``a`` and ``b`` to ``rate`` each way, every other link of
        theirs staying at ``link_rate``: each one's eth0 sends through an ``htb`` whose
        default class runs at ``link_rate`` and whose class for the other's address at
        ``rate``. Replaces what :meth:`shape` put at the root of their eth0 (the token
        bucket; netem too, so delay with the switch's :meth:`delay_packets` or the relay's
        :meth:`delay_streams`).

        Raises:
            LabError: a ``tc`` command failed.
        """
        for me, other in ((a, b), (b, a)):
            host = self.names[me]
            tc = ("tc", "-n", host)
            _run(*tc, "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb",
                 "default", "10")
            _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10",
                 "htb", "rate", link_rate)
            _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20",
                 "htb", "rate", rate)
            _run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                 "prio", "1", "u32", "match", "ip", "dst", f"{address(other)}/32",
                 "flowid", "1:20")


def seconds(delay: str) -> float:
    """A ``tc`` time (``25ms``, ``500us``, ``0.5ms``, ``1s``) in seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", delay)
    if match is None:
        raise ValueError(f"{delay!r} is not a tc time such as 25ms")
    return float(match.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[match.group(2)]


# --- the delay relay (this file run as ``python netns.py relay`` inside a host) ------------

async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                limit: int) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read, holding
    at most ``limit`` bytes; half-closes ``writer`` at the end of ``reader``."""
    loop = asyncio.get_running_loop()
    held: deque[tuple[float, bytes]] = deque()
    arrived, room = asyncio.Event(), asyncio.Event()
    ended = False
    size = 0

    async def take() -> None:
        nonlocal ended, size
        while data := await reader.read(1 << 18):
            held.append((loop.time() + delay, data))
            size += len(data)
            arrived.set()
            while size > limit:
                room.clear()
                await room.wait()
        ended = True
        arrived.set()

    taking = asyncio.create_task(take())
    try:
        while True:
            if not held:
                if ended:
                    break
                arrived.clear()
                await arrived.wait()
                continue
            due, data = held.popleft()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            writer.write(data)
            await writer.drain()
            size -= len(data)
            room.set()
        await taking
        if writer.can_write_eof():
            writer.write_eof()
    finally:
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)


async def _connect_on(destination: tuple[str, int], patience: float = 10.0
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to ``destination`` past the relay's own rule; retried while it refuses (the
    opener's connection to the relay was accepted already: its SYN would have been sent
    again)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + patience
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, RELAY_MARK)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, destination)
        except OSError:
            sock.close()
            if loop.time() > give_up:
                raise
            await asyncio.sleep(0.05)
            continue
        return await asyncio.open_connection(sock=sock)


async def _relay(port: int, delay: float, limit: int) -> None:
    # The loop holds tasks weakly: a connection's task that waits on its sockets could be
    # collected (and its connection stall) unless something holds it until it ends.
    live: set[asyncio.Task[Any]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        live.add(me)
        try:
            await relay(reader, writer)
        finally:
            live.discard(me)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        destination = (socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big"))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            far_reader, far_writer = await _connect_on(destination)
        except OSError:
            writer.close()
            return
        pipes = [asyncio.create_task(_pipe(reader, far_writer, delay, limit)),
                 asyncio.create_task(_pipe(far_reader, writer, delay, limit))]
        # Until both directions have ended, or one of them fails (a reset): then both go.
        await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        for w in (writer, far_writer):
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the lab's delay relay (see the docstring)")
    parser.add_argument("role", choices=["relay"])
    parser.add_argument("--delay", type=float, required=True, help="seconds each way")
    parser.add_argument("--limit", type=int, default=4 << 20, help="bytes held per direction")
    parser.add_argument("--port", type=int, default=RELAY_PORT)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_relay(args.port, args.delay, args.limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
