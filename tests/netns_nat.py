"""Hosts behind NAT on one machine: public hosts on a switch, and hosts behind routers that
masquerade (iptables MASQUERADE) and forward no port in. Used by tests/test_relay_nat.py;
needs root, ``ip`` and ``iptables``. Builds on :mod:`netns` (its helpers, not its Lab).

A :class:`NatLab` of N hosts, ``natted`` of them behind NAT, is named
``p2pcoll-nat-<pid>-<n>-*``:

    sw      the switch: bridge br0 (public side, 198.18.0.0/24)
    hR      host R: public at 198.18.0.(R+1), or private at 198.19.R.2/24 behind rtR
    rtR     the router of a NATed host R: public leg 198.18.0.(101+R), private leg
            198.19.R.1; it masquerades what leaves by its public leg, lets in only what
            answers a connection from inside (conntrack ESTABLISHED,RELATED), and forwards
            no port: a public host has no route to 198.19.0.0/16 at all

How a router treats an unexpected TCP SYN on its public leg (``unexpected``): ``rst`` (the
default) answers it with a reset, as a Linux router with no listener does, ``drop`` drops
it silently, as many firewalls do. ``random_fully``: MASQUERADE ``--random-fully``, which
maps every connection to a random port (a NAT that keeps no port).

Only 198.18.0.0/15 appears, and only inside the lab's namespaces. :meth:`NatLab.close`
kills what runs inside and deletes the namespaces; never raises. :func:`sweep` removes the
labs of makers that are gone.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence

import netns

PREFIX = "p2pcoll-nat-"
_NAME = re.compile(re.escape(PREFIX) + r"([1-9][0-9]*)-([0-9]+)-(sw|h[0-9]+|rt[0-9]+)")


def unavailable() -> str | None:
    """Why no NAT lab can be made here, or None."""
    reason = netns.unavailable()
    if reason is None and shutil.which("iptables") is None:
        reason = "`iptables` is not installed: apt-get install -y iptables"
    return reason


def sweep() -> list[str]:
    removed = []
    for name in netns._namespaces():
        match = _NAME.fullmatch(name)
        if match is not None and netns._gone(int(match.group(1))):
            netns._delete(name)
            removed.append(name)
    return removed


class NatLab(netns.Namespaces):
    """``hosts`` hosts, those in ``natted`` behind a NAT router each; see the module
    docstring. A context manager."""

    prefix = PREFIX

    def __init__(self, hosts: int, natted: Sequence[int], unexpected: str = "rst",
                 random_fully: bool = False) -> None:
        super().__init__(hosts)
        if unexpected not in ("rst", "drop", "stack"):
            raise ValueError(f"unexpected={unexpected!r}: 'rst' or 'drop'")
        self.unexpected = unexpected
        self.random_fully = random_fully
        self.natted = frozenset(natted)
        self.routers = {r: f"{self.tag}-rt{r}" for r in sorted(self.natted)}

    def address(self, rank: int) -> str:
        """Host ``rank``'s own address (a private one behind NAT)."""
        return f"198.19.{rank}.2" if rank in self.natted else netns.address(rank)

    def _port(self, index: int, namespace: str, address: str) -> None:
        """A switch port ``p<index>`` whose far end is ``eth0`` of ``namespace``."""
        run = netns._run
        run("ip", "-n", self.switch, "link", "add", f"p{index}", "type", "veth",
            "peer", "name", "eth0", "netns", namespace)
        run("ip", "-n", self.switch, "link", "set", f"p{index}", "master", "br0")
        run("ip", "-n", self.switch, "link", "set", f"p{index}", "up")
        run("ip", "-n", namespace, "link", "set", "lo", "up")
        run("ip", "-n", namespace, "address", "add", f"{address}/24", "dev", "eth0")
        run("ip", "-n", namespace, "link", "set", "eth0", "up")

    def create(self) -> None:
        """Make it; raises :class:`netns.LabError` if a step fails."""
        sweep()
        run = netns._run
        for name in (self.switch, *self.names, *self.routers.values()):
            run("ip", "netns", "add", name)
            self._made.append(name)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for r, host in enumerate(self.names):
            if r not in self.natted:
                self._port(r, host, netns.address(r))
                continue
            router = self.routers[r]
            self._port(100 + r, router, f"198.18.0.{101 + r}")
            run("ip", "-n", router, "link", "add", "lan0", "type", "veth",
                "peer", "name", "eth0", "netns", host)
            run("ip", "-n", router, "address", "add", f"198.19.{r}.1/24", "dev", "lan0")
            run("ip", "-n", router, "link", "set", "lan0", "up")
            run("ip", "-n", host, "link", "set", "lo", "up")
            run("ip", "-n", host, "address", "add", f"198.19.{r}.2/24", "dev", "eth0")
            run("ip", "-n", host, "link", "set", "eth0", "up")
            run("ip", "-n", host, "route", "add", "default", "via", f"198.19.{r}.1")
            run("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            ipt = ("ip", "netns", "exec", router, "iptables")
            run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE",
                *(["--random-fully"] if self.random_fully else []))
            run(*ipt, "-A", "FORWARD", "-i", "eth0", "-m", "conntrack", "--ctstate",
                "ESTABLISHED,RELATED", "-j", "ACCEPT")
            run(*ipt, "-A", "FORWARD", "-i", "eth0", "-j", "DROP")
            run(*ipt, "-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate",
                "ESTABLISHED,RELATED", "-j", "ACCEPT")
            if self.unexpected == "drop":
                run(*ipt, "-A", "INPUT", "-i", "eth0", "-j", "DROP")
            elif self.unexpected == "rst":
                run(*ipt, "-A", "INPUT", "-i", "eth0", "-p", "tcp", "-j", "REJECT",
                    "--reject-with", "tcp-reset")
                run(*ipt, "-A", "INPUT", "-i", "eth0", "-j", "DROP")

    def shape(self, rate: str, burst: str = "512kbit", latency: str = "50ms") -> None:
        """Every site's cable to ``rate`` each way (a token bucket at both ends: a public
        host's eth0 or a router's public leg, and its switch port); a NATed host's own
        cable to its router is not limited."""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        for r, host in enumerate(self.names):
            port, end = (100 + r, self.routers[r]) if r in self.natted else (r, host)
            netns._run("tc", "-n", self.switch, "qdisc", "add", "dev", f"p{port}", "root", *tbf)
            netns._run("tc", "-n", end, "qdisc", "add", "dev", "eth0", "root", *tbf)

    def listening(self, rank: int) -> list[str]:
        """The TCP addresses something listens on in host ``rank`` (``ss -ltn``)."""
        out = subprocess.run(["ip", "netns", "exec", self.names[rank], "ss", "-ltnH"],
                             capture_output=True, text=True, check=True, timeout=10).stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

