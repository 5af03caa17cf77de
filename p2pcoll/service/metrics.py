"""The ``/metrics`` page: a peer's counters in Prometheus's text format.

Every number is read, at scrape time, from the peer's group (:meth:`p2pcoll.Group.stats`:
the transport's traffic counters and the group's record of its collectives) and from the
peer's own count of errors outside collectives (failed joins): there is no second
bookkeeping to drift from them. The collector is registered in a registry of the peer's
own, so several peers in one process do not collide.

==========================================  =========  ==================================
metric                                      type       labels
==========================================  =========  ==================================
``p2pcoll_collectives_total``               counter    ``collective``, ``strategy``
``p2pcoll_collective_seconds``              histogram  ``collective``
``p2pcoll_bytes_sent_total``                counter
``p2pcoll_bytes_received_total``            counter
``p2pcoll_messages_dropped_total``          counter    ``reason``
``p2pcoll_links_refused_total``             counter
``p2pcoll_errors_total``                    counter    ``type``
``p2pcoll_world_size``                      gauge
``p2pcoll_rank``                            gauge
``p2pcoll_members_gone``                    gauge
``p2pcoll_state``                           gauge      ``state`` (1 for the current one)
``p2pcoll_http_closed_total``               counter    ``reason``
``p2pcoll_http_paused_total``               counter    ``reason``
==========================================  =========  ==================================

Counters count from the current group's join: a peer that joins anew starts them again,
which Prometheus's ``rate()`` treats as a counter reset. The two ``p2pcoll_http_*``
counters are the HTTP server's own (connections it closed before answering, times it
stopped accepting; see :mod:`p2pcoll.service.http`) and count from its start.

``p2pcoll_members_gone`` counts the members that have left the group or been lost (the
group is then ``degraded``, see :class:`p2pcoll.GroupState`). Only counts, states and this
peer's rank are served: nothing that helps an outsider reach
or pass for a member (no group id, link secret, endpoint, host or key material).
``p2pcoll_links_refused_total`` counts the connections to the peer's mesh port that were
no member's link (a stranger's, or an impostor's: a second connection claiming a member's
rank, whose messages are dropped as ``impostor``; also a member's own link that
reconnected after its connection dropped): see
:class:`p2pcoll.transport.sockets.LinkCensus`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .view import PeerView

STATES = ("starting", "forming", "ready", "degraded", "broken", "closed")


class PeerCollector(Collector):
    """Reads one peer's counters whenever Prometheus scrapes."""

    def __init__(self, peer: PeerView) -> None:
        self.peer = peer

    def collect(self) -> Iterator[Metric]:
        peer = self.peer
        stats = peer.stats()
        _, health = peer.health()

        collectives = CounterMetricFamily(
            "p2pcoll_collectives", "Collectives run, by collective and strategy.",
            labels=["collective", "strategy"])
        for collective, by in stats.get("collectives_by_strategy", {}).items():
            for strategy, n in by.items():
                collectives.add_metric([collective, strategy], n)
        yield collectives

        seconds = HistogramMetricFamily(
            "p2pcoll_collective_seconds", "Time per collective, seconds.",
            labels=["collective"])
        for collective, h in stats.get("collective_seconds", {}).items():
            buckets = [(_bound(le), n) for le, n in h["buckets"]]
            seconds.add_metric([collective], buckets, sum_value=h["sum"])
        yield seconds

        for name, key, what in (
            ("p2pcoll_bytes_sent", "bytes_sent", "Payload bytes sent to peers."),
            ("p2pcoll_bytes_received", "bytes_received", "Payload bytes received from peers."),
        ):
            yield CounterMetricFamily(name, what, value=stats.get(key, 0))

        dropped = CounterMetricFamily(
            "p2pcoll_messages_dropped",
            "Incoming messages dropped (malformed, from strangers, over the cap, ...), "
            "by reason.", labels=["reason"])
        for reason, n in stats.get("messages_dropped_by_reason", {}).items():
            dropped.add_metric([reason], n)
        yield dropped

        yield CounterMetricFamily(
            "p2pcoll_links_refused",
            "Connections to the mesh port that were no member's link (a stranger's or an "
            "impostor's: none is read as a member's).",
            value=stats.get("links_refused", 0))

        errors = CounterMetricFamily(
            "p2pcoll_errors", "Errors raised by collectives and joins, by type.",
            labels=["type"])
        by_type = dict(stats.get("errors_by_type", {}))
        for name, n in peer.errors.items():
            by_type[name] = by_type.get(name, 0) + n
        for name, n in sorted(by_type.items()):
            errors.add_metric([name], n)
        yield errors

        for name, key, what in (("p2pcoll_world_size", "world_size", "Peers in the group."),
                                ("p2pcoll_rank", "rank", "This peer's rank."),
                                ("p2pcoll_members_gone", "gone",
                                 "Members that have left the group or been lost.")):
            gauge = GaugeMetricFamily(name, what)
            if key in health or (key == "gone" and "world_size" in health):
                gauge.add_metric([], health.get(key, 0))
            yield gauge

        state = GaugeMetricFamily("p2pcoll_state", "The peer's state (1 for the current).",
                                  labels=["state"])
        for s in STATES:
            state.add_metric([s], 1.0 if health["state"] == s else 0.0)
        yield state


def _bound(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(float(le))


def registry_for(peer: PeerView) -> CollectorRegistry:
    """A registry of its own holding ``peer``'s collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PeerCollector(peer))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition of everything in ``registry``."""
    return generate_latest(registry)
