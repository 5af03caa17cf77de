"""How many pipeline segments of one collective are in flight: enough to fill its paths.

The executor runs up to ``depth`` segments of a collective at once, so each link the
collective uses carries about ``depth x segment_bytes`` at a time (a ring's: one message of
each segment in flight). A path of bandwidth ``B`` and round trip ``RTT`` needs ``B x RTT``
bytes in flight to run at its rate (its bandwidth-delay product: 12.5 MB at 1 Gbit/s and
100 ms); with less, it moves at most the window per round trip, however wide the TCP windows
under it are (the stripes and socket buffers of :mod:`p2pcoll.transport.paths`). So, unless
the depth is set (``P2PCOLL_PIPELINE_DEPTH``), :func:`pipeline_depth` takes per collective

    depth = ceil(max over its peers of RTT x B / segment_bytes),
            at least DEFAULT_PIPELINE_DEPTH (4: today's window on a short path),
            at most  MAX_WINDOW_BYTES / segment_bytes and MAX_PIPELINE_DEPTH

- **RTT**: the path's measured round trip (its links' handshakes, or a measurement handed to
  the transport). A peer of this host, or one whose path is not measured yet, counts as a
  short path.
- **B**: the path's measured bandwidth, else :data:`~p2pcoll.transport.paths.DEFAULT_BANDWIDTH_BPS`
  (10 Gbit/s), an upper bound for most paths: the window errs long (bounded by the cap), never
  short. The topology probe hands over its figure only for a short path (product within half
  its train's flight, :data:`p2pcoll.api.topology.SHORT_PATH_BYTES`): on a long path its
  train may still be in TCP's start-up, and would size the window below the product.
- **The cap** bounds memory: segments in flight hold their received pieces until folded in,
  and their snapshot sends as copies (:func:`p2pcoll.engine.plan.copies`).

The rule is a pure function of the paths, so every rank of a pair sees about the same window,
and the depth never changes what is computed: segments are independent copies of the
schedule, folded in the same order whatever their number in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..settings_env import DEFAULT_PIPELINE_DEPTH, MAX_PIPELINE_DEPTH
from ..transport.paths import DEFAULT_BANDWIDTH_BPS

__all__ = ["MAX_WINDOW_BYTES", "PathInfo", "bdp_bytes", "pipeline_depth"]

MAX_WINDOW_BYTES = 32 << 20
"""The most one collective keeps in flight on a link whatever the path (32 MiB: the product of
2.7 Gbit/s at 100 ms, of 10 Gbit/s at 27 ms)."""

PathInfo = tuple[float | None, float | None]
"""What is known of the path to a peer: (round-trip seconds, bytes/s); None: not measured."""


def bdp_bytes(rtt_s: float | None, bandwidth_Bps: float | None = None) -> float:
    """The bandwidth-delay product of a path, bytes; 0 when its round trip is unknown.

    >>> bdp_bytes(0.1, 125e6)  # 1 Gbit/s, 100 ms
    12500000.0
    >>> bdp_bytes(0.1)  # bandwidth unknown: 10 Gbit/s assumed
    125000000.0
    >>> bdp_bytes(None, 125e6)
    0.0
    """
    if rtt_s is None or not rtt_s > 0 or not math.isfinite(rtt_s):
        return 0.0
    bandwidth = bandwidth_Bps if bandwidth_Bps is not None and bandwidth_Bps > 0 else (
        DEFAULT_BANDWIDTH_BPS)
    return rtt_s * bandwidth


def pipeline_depth(paths: Iterable[PathInfo], segment_bytes: int, *,
                   floor: int = DEFAULT_PIPELINE_DEPTH,
                   cap_bytes: int = MAX_WINDOW_BYTES) -> int:
    """The segments of one collective to keep in flight over ``paths`` (those to its peers),
    cut into segments of ``segment_bytes``: see the module docstring.

    Args:
        paths: ``(rtt_s, bandwidth_Bps)`` of the path to each peer (None: not measured).
        segment_bytes: the pipeline's segment size (> 0).
        floor: the depth of a short path.
        cap_bytes: the most bytes in flight per link.

    Returns:
        From ``floor`` to ``max(floor, min(cap_bytes // segment_bytes, MAX_PIPELINE_DEPTH))``.

    >>> pipeline_depth([(0.1, 125e6)], 1 << 20)  # 1 Gbit/s, 100 ms: 12.5 MB
    12
    >>> pipeline_depth([(0.2e-3, None)], 1 << 20)  # a LAN: 250 kB, today's 4
    4
    >>> pipeline_depth([(0.1, None), (None, None)], 1 << 20)  # capped at 32 MiB
    32
    """
    need = max((bdp_bytes(rtt, bw) for rtt, bw in paths), default=0.0)
    segment = max(1, segment_bytes)
    top = max(floor, min(cap_bytes // segment, MAX_PIPELINE_DEPTH))
    return min(top, max(floor, math.ceil(need / segment)))
