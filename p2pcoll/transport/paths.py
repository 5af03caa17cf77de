"""The path to each peer: its round trip and bandwidth, and what follows from them: how
many TCP connections (stripes) a link to it spreads large messages over, and how large
their send buffers are.

A path of bandwidth ``B`` and round trip ``RTT`` holds ``B * RTT`` bytes in flight (its
bandwidth-delay product: 12.5 MB at 1 Gbit/s and 100 ms). One TCP connection keeps at most
its window in flight, so it moves at most ``window / RTT`` whatever the line rate, and the
kernel bounds the window by the socket's buffers: autotuned up to the last field of
``net.ipv4.tcp_wmem`` / ``tcp_rmem``, or set (``SO_SNDBUF``) up to ``net.core.wmem_max``.
Part of a buffer holds data in flight (the rest is the kernel's bookkeeping): half of a
receive buffer (``net.ipv4.tcp_adv_win_scale``), and of a send buffer
:data:`SEND_BUFFER_SHARE` (measured). So:

- :func:`choose_streams` (``streams=auto``): enough connections that their windows fill
  the bandwidth-delay product, ``ceil(B * RTT / window)``, from 1 to :data:`MAX_AUTO_STREAMS`
  per host: a host's line carries its links to all the remote peers a collective sends to
  at once, one (a ring's neighbour) to all of them (a direct exchange), so each of those
  pairs takes its share of the product and of the cap: the collective's program says how
  many (:meth:`.route.Routes.drive`);
- :func:`send_buffer`: each connection's send buffer, its share of the product (over
  :data:`SEND_BUFFER_SHARE`, what of a buffer is in flight), set only where autotuning
  would stop short of it, and capped by ``wmem_max``, which is then said
  (``socket_buffers_capped`` and a warning).
  The receiving side cannot be sized per path (a peer's one ROUTER is bound before any
  path is measured): it autotunes up to ``tcp_rmem``'s maximum, and a warning says so when
  that is below a stripe's share.

The round trip is measured on each link as it opens: the time from connect to the end of
the ZMTP handshake, which takes about :data:`HANDSHAKE_TRIPS` round trips (TCP's, the
greetings and READY; CURVE's HELLO/WELCOME and INITIATE/READY on top). The bandwidth is not
measured here: :data:`DEFAULT_BANDWIDTH_BPS` is assumed until something measures it and
says so with :meth:`Paths.measure` (a probe of the topology, say): ``auto`` then takes it
for the links opened from then on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from ..settings_env import MAX_STREAMS

log = logging.getLogger("p2pcoll.transport")

__all__ = [
    "DEFAULT_BANDWIDTH_BPS", "HANDSHAKE_TRIPS", "MAX_AUTO_STREAMS", "SEND_BUFFER_SHARE",
    "Buffers", "Paths", "choose_streams", "send_buffer",
]

DEFAULT_BANDWIDTH_BPS = 1.25e9
"""Bytes per second assumed of a path whose bandwidth nobody measured (10 Gbit/s): an upper
bound for most paths between hosts, so ``auto`` errs towards a few connections too many
(cheap), not too few (a long link at a fraction of its rate)."""
MAX_AUTO_STREAMS = 4
"""The connections ``auto`` keeps sending at once from one host, at most (``MAX_STREAMS`` may
be asked for): four hold 11.7 MB in flight at 2.9 MB each (autotuned 4 MiB send buffers),
about a 1 Gbit/s line at 100 ms. Measured on the lab's packet delayer (4 hosts, 50 ms one
way, 64 MiB, a crowded machine): the ring at 4 per pair led the ring at 6 in 9 labs of 13
(74-87 % against 43-80 % where it led by most; benchmarks/README.md), and the direct
exchange at 2 per pair (6 from the host) trailed the ring at 4; 8 per pair fell below
all. Plain TCP through the same lab moves a rank's bytes as fast over 4 connections as over
6: more connections send more, smaller packets, and each message crosses at a smaller share
of the line."""
SEND_BUFFER_SHARE = 0.7
"""What of its send buffer one connection keeps in flight (the kernel counts each packet's
bookkeeping against the buffer too). Measured on the lab's packet delayer
(``benchmarks/lab_delay.py``, 100 ms): an autotuned 4 MiB send buffer held 2.9 MB in flight
(231 Mbit/s), not the half (2 MiB) that the receive side's window would be."""
# Round trips of a handshake, by CURVE or not: TCP's (1), the greetings and READY (2), CURVE's
# HELLO/WELCOME and INITIATE/READY (2 more). Measured over the lab's packet delay at 100 ms:
# 3.02 and 5.5 (2 and 4 before counted no TCP handshake: the old lab's delay relay answered
# it inside the connecting host, so the round trips read 1.5x the path's).
HANDSHAKE_TRIPS = {False: 3.0, True: 5.0}


@dataclass(frozen=True)
class Buffers:
    """The kernel's bounds on socket buffers (bytes), from ``/proc/sys/net``."""

    wmem_max: int = 4 << 20  # net.core.wmem_max: the most SO_SNDBUF may set
    rmem_max: int = 4 << 20  # net.core.rmem_max
    tcp_wmem_max: int = 4 << 20  # net.ipv4.tcp_wmem's last field: autotuning's bound
    tcp_rmem_max: int = 6 << 20  # net.ipv4.tcp_rmem's

    @classmethod
    def read(cls, root: Path = Path("/proc/sys/net")) -> Buffers:
        """This machine's bounds; the defaults for what cannot be read."""
        def value(name: str, default: int) -> int:
            try:
                return int((root / name).read_text().split()[-1])
            except (OSError, ValueError, IndexError):
                return default
        d = cls()
        return cls(value("core/wmem_max", d.wmem_max), value("core/rmem_max", d.rmem_max),
                   value("ipv4/tcp_wmem", d.tcp_wmem_max),
                   value("ipv4/tcp_rmem", d.tcp_rmem_max))

    @property
    def window(self) -> int:
        """The most one connection keeps in flight, the smaller of what the sending side
        (:data:`SEND_BUFFER_SHARE` of its largest buffer) and the receiving side (half of
        its largest, the window it advertises) can have.

        >>> Buffers(tcp_wmem_max=4 << 20, tcp_rmem_max=32 << 20).window  # the lab's: 2.9 MB
        2936012
        >>> Buffers(tcp_rmem_max=4 << 20).window  # the receiver binds: half its 4 MiB
        2097152
        """
        send = max(self.tcp_wmem_max, self.wmem_max)
        receive = max(self.tcp_rmem_max, self.rmem_max)
        return max(1, min(int(send * SEND_BUFFER_SHARE), receive // 2))


def choose_streams(rtt_s: float, bandwidth_Bps: float | None = None, *,
                   window_bytes: int | None = None, sharing: int = 1) -> int:
    """The connections to one peer whose windows, with those to the ``sharing - 1`` other
    peers a collective sends to at the same time, fill a path's bandwidth-delay product.

    Args:
        rtt_s: the path's round trip, seconds.
        bandwidth_Bps: its bandwidth, bytes per second (None: :data:`DEFAULT_BANDWIDTH_BPS`).
        window_bytes: what one connection keeps in flight (None: this machine's,
            :attr:`Buffers.window`).
        sharing: the remote peers the running collective sends to at once, whose links
            share this host's line (at least 1): each pair fills its share of the
            product, and the host's connections stay within :data:`MAX_AUTO_STREAMS`
            (one each, at least, when more peers than that share it).

    Returns:
        From 1 to ``max(1, MAX_AUTO_STREAMS // sharing)``.

    >>> choose_streams(100e-3, 125e6, window_bytes=2 << 20)  # 1 Gbit/s, 100 ms: 12.5 MB
    4
    >>> choose_streams(0.2e-3, 125e6, window_bytes=2 << 20)  # the same, 0.2 ms: one
    1
    >>> choose_streams(100e-3, 125e6, window_bytes=2 << 20, sharing=3)  # 3 peers at once
    1
    >>> choose_streams(100e-3, None, window_bytes=2 << 20, sharing=2)  # 10 Gbit/s assumed
    2
    """
    if not rtt_s > 0:
        return 1
    bandwidth = DEFAULT_BANDWIDTH_BPS if bandwidth_Bps is None else bandwidth_Bps
    window = Buffers.read().window if window_bytes is None else window_bytes
    sharing = max(1, sharing)
    product = rtt_s * max(bandwidth, 1.0)
    shared = math.ceil(product / (max(window, 1) * sharing))
    top = max(1, MAX_AUTO_STREAMS // sharing)
    return max(1, min(top, MAX_STREAMS, shared))


def send_buffer(rtt_s: float, bandwidth_Bps: float | None, streams: int,
                buffers: Buffers) -> tuple[int, bool]:
    """The ``SO_SNDBUF`` of each of ``streams`` connections of a path, and whether the
    system's maximum held it below the path's need.

    Returns:
        ``(bytes, capped)``: bytes 0 when autotuning reaches the need (nothing is set:
        an explicit size would turn autotuning off); else what to set, at most
        ``wmem_max``; ``capped``: the need is beyond both.

    >>> b = Buffers(wmem_max=16 << 20, tcp_wmem_max=4 << 20)
    >>> send_buffer(0.1, 125e6, 4, b)  # 12.5 MB over 4: 3.1 MB each, in 0.7 of a buffer
    (4464286, False)
    >>> send_buffer(0.001, 125e6, 1, b)  # 125 kB: autotuning does it
    (0, False)
    >>> send_buffer(0.1, 125e6, 4, Buffers(wmem_max=4 << 20, tcp_wmem_max=4 << 20))
    (0, True)

    (With ``wmem_max`` no higher than autotuning's bound, setting a size would only lose
    autotuning: nothing is set, and the cap is said.)
    """
    if not rtt_s > 0:
        return 0, False
    bandwidth = DEFAULT_BANDWIDTH_BPS if bandwidth_Bps is None else bandwidth_Bps
    need = math.ceil(rtt_s * bandwidth / max(1, streams) / SEND_BUFFER_SHARE)
    if need <= buffers.tcp_wmem_max:
        return 0, False
    if buffers.wmem_max <= buffers.tcp_wmem_max:  # setting it would only lose autotuning
        return 0, True
    return min(need, buffers.wmem_max), need > buffers.wmem_max


@dataclass
class Measured:
    """What is known of the path to one peer."""

    rtt_s: float | None = None
    bandwidth_Bps: float | None = None
    probed: bool = False  # the round trip came from measure(), not from handshakes


class Paths:
    """The measured paths of one peer, by peer rank (see the module docstring).

    ``measure`` is how a measurement comes in: the mesh's links report their handshake
    round trips; a measured bandwidth (a probe of the topology, say) goes in the same way,
    and ``streams`` uses it for every link opened from then on.
    """

    def __init__(self, buffers: Buffers | None = None) -> None:
        self.buffers = buffers if buffers is not None else Buffers.read()
        self._paths: dict[int, Measured] = {}
        self._warned: set[str] = set()

    def measure(self, peer: int, rtt_s: float | None = None,
                bandwidth_Bps: float | None = None) -> None:
        """Record a measurement of the path to ``peer`` (None: not measured): it replaces
        what was known, and handshakes no longer change the round trip."""
        path = self._paths.setdefault(peer, Measured())
        if rtt_s is not None and rtt_s > 0:
            path.rtt_s, path.probed = rtt_s, True
        if bandwidth_Bps is not None and bandwidth_Bps > 0:
            path.bandwidth_Bps = bandwidth_Bps

    def handshake(self, peer: int, rtt_s: float) -> None:
        """A round trip estimated from a link's handshake: the smallest seen is kept (a
        handshake can only take longer than its round trips), unless measured otherwise."""
        path = self._paths.setdefault(peer, Measured())
        if rtt_s > 0 and not path.probed:
            path.rtt_s = rtt_s if path.rtt_s is None else min(path.rtt_s, rtt_s)

    def rtt(self, peer: int) -> float | None:
        path = self._paths.get(peer)
        return None if path is None else path.rtt_s

    def bandwidth(self, peer: int) -> float | None:
        path = self._paths.get(peer)
        return None if path is None else path.bandwidth_Bps

    def streams(self, peer: int, sharing: int = 1) -> int | None:
        """What ``auto`` chooses for ``peer`` when this host's line carries links to
        ``sharing`` remote peers at once (see :func:`choose_streams`); None while its round
        trip is unknown."""
        path = self._paths.get(peer)
        if path is None or path.rtt_s is None:
            return None
        return choose_streams(path.rtt_s, path.bandwidth_Bps,
                              window_bytes=self.buffers.window, sharing=sharing)

    def send_buffer(self, peer: int, streams: int) -> tuple[int, bool]:
        """The send buffer of each of ``streams`` connections to ``peer`` (see
        :func:`send_buffer`; ``(0, False)`` while its round trip is unknown), and a
        warning, once per kind, where the system's maxima bind: said (and ``capped``)
        only once the path's bandwidth is measured, not of the assumed one."""
        path = self._paths.get(peer)
        if path is None or path.rtt_s is None:
            return 0, False
        size, capped = send_buffer(path.rtt_s, path.bandwidth_Bps, streams, self.buffers)
        if path.bandwidth_Bps is None:
            # The need comes from the assumed bandwidth (10 Gbit/s): whether the maxima
            # bind is not known, so nothing is said or counted (a 100 Mbit/s path with a
            # 50 ms round trip needs 0.6 MB, not the 62.5 MB assumed).
            return size, False
        share = path.rtt_s * path.bandwidth_Bps / streams
        if capped:
            self._warn("wmem", f"the send buffers a path to rank {peer} needs "
                       f"({2 * share / 2**20:.1f} MiB for each of {streams} connections) are "
                       f"beyond net.core.wmem_max ({self.buffers.wmem_max >> 10} KiB): "
                       f"raise it (sysctl -w net.core.wmem_max=...) or the streams")
        if 2 * share > max(self.buffers.tcp_rmem_max, self.buffers.rmem_max):
            self._warn("rmem", f"the receive window a path to rank {peer} needs "
                       f"({2 * share / 2**20:.1f} MiB per connection) is beyond "
                       f"net.ipv4.tcp_rmem's maximum ({self.buffers.tcp_rmem_max >> 10} KiB)"
                       f" at its peer if that peer is like this one: raise it there")
        return size, capped

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", message)
