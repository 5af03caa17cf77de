"""The cost model on long paths (issue 36): the round trip each step waits for, and what the
connections' windows let through, as pure functions of measured matrices (no sockets).

- the windows bound each pair at ``k * window / rtt``, ``k`` what ``streams=auto`` takes for
  the program (the ring 4, Rabenseifner 2, the direct exchange 1 per pair) or ``streams=k``;
- the latency: half a round trip beyond alpha per step (the ring 2(p - 1), Rabenseifner
  2 lg p, the direct exchange 2), of which the segments in flight hide all but one step's
  when their data covers the chain;
- 4 ranks at 1 Gbit/s and 100 ms: auto picks what the lab measured fastest, with one
  connection per pair as with ``streams=auto``;
- on a LAN every prediction is today's: picks pinned for a few matrices, and a property over
  random LAN matrices;
- the probe's rows carry every rank's window, and :func:`topology.price` hands the model the
  round trips, the window, the streams setting and the executor's depth, a long path's
  figure not taken for its rate.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pcoll.api import topology
from p2pcoll.api.topology import Topology
from p2pcoll.engine.costs import DEFAULT_CONSTANTS, CostModel
from p2pcoll.engine.long_paths import (
    destinations,
    exposed_seconds,
    step_seconds,
    window_rates,
    wire_seconds,
)
from p2pcoll.registry import registry
from p2pcoll.testing import memory_groups, run_virtual
from p2pcoll.transport.paths import DEFAULT_BANDWIDTH_BPS

WINDOW = 2 << 20  # the lab's: autotuned 4 MiB send buffers, half in flight
ALPHA = DEFAULT_CONSTANTS["tcp"].alpha
TCP = DEFAULT_CONSTANTS["tcp"]
MiB = 1 << 20


def matrix(p: int, value: float) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(0.0 if i == j else value for j in range(p)) for i in range(p))


def long_model(p: int = 4, *, streams: int = 0, rate: float = DEFAULT_BANDWIDTH_BPS,
               rtt: float = 0.1, window: int = WINDOW, depth: int = 32) -> CostModel:
    """The model a group of ``p`` hosts gets on paths of ``rtt`` (price()'s: a long path's
    rate is the transport's assumption, the executor's depth 32)."""
    return CostModel(TCP, depth=depth, links=matrix(p, rate), rtts=matrix(p, rtt),
                     window=window, streams=streams)


@pytest.mark.parametrize(("name", "width", "peers"), [
    ("ring", 4, {1}), ("rabenseifner", 2, {1, 2}), ("direct", 1, {1, 2, 3})])
def test_the_windows_bound_each_pair_by_the_programs_width(
        name: str, width: int, peers: set[int]) -> None:
    strategy = registry.get("allreduce", name)
    assert destinations(strategy, 4)[0] == frozenset(peers)
    rates = window_rates(strategy, 4, matrix(4, 0.1), matrix(4, DEFAULT_BANDWIDTH_BPS), WINDOW)
    assert rates is not None
    assert rates[0][1] == pytest.approx(width * WINDOW / 0.1)
    one = window_rates(strategy, 4, matrix(4, 0.1), matrix(4, DEFAULT_BANDWIDTH_BPS), WINDOW,
                       streams=1)
    assert one is not None and one[0][1] == pytest.approx(WINDOW / 0.1)
    # A pair on one host has no window; a LAN's windows never bind (nothing to bound).
    hosts = (0, 0, 1, 2)
    same = window_rates(strategy, 4, matrix(4, 0.1), matrix(4, DEFAULT_BANDWIDTH_BPS),
                        WINDOW, hosts=hosts)
    assert same is None or same[0][1] == float("inf")
    assert window_rates(strategy, 4, matrix(4, 2e-4), matrix(4, 1.25e8), WINDOW) is None
    assert window_rates(strategy, 4, matrix(4, 0.1), matrix(4, 1.25e8), 0) is None


@pytest.mark.parametrize(("name", "steps"), [
    ("ring", 6), ("rabenseifner", 4), ("direct", 2), ("recursive_doubling", 2)])
def test_every_step_waits_for_half_a_round_trip_beyond_alpha(name: str, steps: int) -> None:
    strategy = registry.get("allreduce", name)
    assert wire_seconds(strategy, 4, matrix(4, 0.1), ALPHA) == pytest.approx(
        steps * (0.05 - ALPHA))
    assert wire_seconds(strategy, 4, matrix(4, 2 * ALPHA), ALPHA) == 0.0


@pytest.mark.parametrize("name", ["ring", "direct", "rabenseifner"])
def test_segments_in_flight_hide_all_but_one_steps_latency(name: str) -> None:
    """The lab's shape (4 hosts, 100 ms, 64 MiB: 16 segments, all in flight): each step's
    latency is half a round trip beyond alpha, and the data (0.5 s and more) covers every
    chain, so one step's latency shows; with one segment in flight (a depth of 1) every
    step's does, as in the lockstep model before."""
    strategy = registry.get("allreduce", name)
    steps = step_seconds(strategy, 4, matrix(4, 0.1), ALPHA)
    one = 0.05 - ALPHA
    assert steps and all(s == pytest.approx(one) for s in steps)
    assert sum(steps) == pytest.approx(wire_seconds(strategy, 4, matrix(4, 0.1), ALPHA))
    assert exposed_seconds(steps, 0.5, 16) == pytest.approx(one)
    assert exposed_seconds(steps, 0.5, 1) == pytest.approx(sum(steps))
    n = 64 * MiB
    deep, shallow = long_model(depth=32), long_model(depth=1)
    if name == "ring":
        assert deep.workload(strategy, n, 4).segments == 16
    gained = shallow.predict(strategy, n, 4) - deep.predict(strategy, n, 4)  # type: ignore[operator]
    # What the depth takes off the prediction is the hidden steps' latency, in every wave.
    assert gained == pytest.approx(
        shallow.workload(strategy, n, 4).waves * sum(steps) - one, rel=0.05)


@given(steps=st.lists(st.floats(0.0, 0.2), min_size=1, max_size=12),
       data=st.floats(0.0, 5.0), segments=st.integers(1, 64), waves=st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_exposed_latency_lies_between_one_step_and_every_step(
        steps: list[float], data: float, segments: int, waves: int) -> None:
    """Per wave, at least one step's latency (the last message's flight) and at most the
    lockstep chain; more data or more segments in flight never show more of it."""
    t = tuple(steps)
    seen = exposed_seconds(t, data, segments, waves)
    assert waves * max(t) - 1e-12 <= seen <= waves * sum(t) + 1e-12
    assert exposed_seconds(t, data * 2, segments, waves) <= seen + 1e-12
    assert exposed_seconds(t, data, segments + 1, waves) <= seen + 1e-12
    assert exposed_seconds(t, data, 1, waves) == pytest.approx(waves * sum(t))


def test_a_long_path_with_one_connection_per_pair_takes_the_direct_exchange() -> None:
    """The lab (4 hosts, 1 Gbit/s, 50 ms one way, 64 MiB, ``streams=1``, 2026-12-07,
    benchmarks/README.md): the direct exchange 66 %, Rabenseifner (the old model's pick)
    37 %, the ring 24 % of the line: one window per pair, three pairs at once against one."""
    n = 64 * MiB
    model = long_model(streams=1)
    times = {name: model.predict(registry.get("allreduce", name), n, 4)
             for name in ("direct", "rabenseifner", "ring")}
    assert times["direct"] < times["rabenseifner"] < times["ring"]  # type: ignore[operator]
    assert registry.auto_name("allreduce", n, 4, model) == "direct"
    # Without the long-path terms (the model before): the bytes are alike, rounds decide.
    before = replace(model, rtts=(), window=0)
    assert registry.auto_name("allreduce", n, 4, before) == "rabenseifner"


def test_a_long_path_with_auto_streams_takes_the_ring() -> None:
    """``streams=auto`` keeps 4 connections from a host (MAX_AUTO_STREAMS): the ring's 4 to
    its one neighbour, Rabenseifner's 2 to each of two partners, the direct exchange's 1 to
    each of three peers; and the 16 segments in flight hide the ring's 6 half round trips
    as they hide the direct exchange's 2, so the ring's fuller windows win (the lab: the
    ring at 4 per pair 74-80 %, the direct exchange 54-61 %; benchmarks/README.md)."""
    n = 64 * MiB
    for rate in (DEFAULT_BANDWIDTH_BPS, 125e6):  # assumed (price's), or measured
        model = long_model(rate=rate)
        times = {name: model.predict(registry.get("allreduce", name), n, 4)
                 for name in ("direct", "rabenseifner", "ring")}
        assert times["ring"] < times["direct"] < times["rabenseifner"]  # type: ignore[operator]
        assert registry.auto_name("allreduce", n, 4, model) == "ring"
    # Small data on the same paths: the fewest steps (recursive doubling's lg p).
    assert registry.auto_name("allreduce", 4096, 4, long_model()) == "recursive_doubling"


@pytest.mark.parametrize("streams", [0, 1])
def test_a_ring_in_measured_order_is_bound_by_its_windows(streams: int) -> None:
    """The probe may order the ring otherwise than by rank (the lab's, with ``streams=1``:
    [0, 3, 2, 1]); that ring is priced over its slowest hop, which the windows bound as
    they bound the ring in rank order (its carried bytes, more than the ring's, through
    them). (They did not: with one connection per pair auto
    took that ring, 20 % of the line in the lab, against the direct exchange's 61 %.)"""
    n = 64 * MiB
    model = replace(long_model(streams=streams), ring=(0, 3, 2, 1))
    ring = registry.get("allreduce", "ring")
    width = 1 if streams else 4
    floor = 2 * 3 / 4 * n / (width * WINDOW / 0.1)  # its bytes through its windows
    assert model.predict(ring, n, 4) >= floor  # type: ignore[operator]
    # One connection a pair: the direct exchange's three windows at once; four: the ring's.
    assert registry.auto_name("allreduce", n, 4, model) == ("direct" if streams else "ring")


# auto's picks on LAN matrices before the long-path terms (commit 37482f6), which must not
# move: (p, rate bytes/s, round trip s) -> {bytes: pick}.
LAN_PICKS = {
    (3, 118e6, 2e-4): {4096: "recursive_doubling", 65536: "ring", MiB: "ring",
                       16 * MiB: "ring", 64 * MiB: "ring"},
    (3, 1.1e9, 1e-4): {4096: "recursive_doubling", 65536: "recursive_doubling", MiB: "ring",
                       16 * MiB: "ring", 64 * MiB: "ring"},
    (4, 118e6, 2e-4): {4096: "recursive_doubling", 65536: "recursive_doubling",
                       MiB: "rabenseifner", 16 * MiB: "rabenseifner",
                       64 * MiB: "rabenseifner"},
    (4, 1.1e9, 1e-4): {4096: "recursive_doubling", 65536: "recursive_doubling",
                       MiB: "recursive_doubling", 16 * MiB: "rabenseifner",
                       64 * MiB: "rabenseifner"},
    (8, 118e6, 2e-4): {4096: "recursive_doubling", 65536: "recursive_doubling",
                       MiB: "rabenseifner", 16 * MiB: "rabenseifner",
                       64 * MiB: "rabenseifner"},
    (8, 1.1e9, 1e-4): {4096: "recursive_doubling", 65536: "recursive_doubling",
                       MiB: "recursive_doubling", 16 * MiB: "rabenseifner",
                       64 * MiB: "rabenseifner"},
}


@pytest.mark.parametrize("case", sorted(LAN_PICKS))
def test_lan_picks_are_unchanged(case: tuple[int, float, float]) -> None:
    p, rate, rtt = case
    model = CostModel(TCP, links=matrix(p, rate), rtts=matrix(p, rtt), window=WINDOW)
    picks = {n: registry.auto_name("allreduce", n, p, model) for n in LAN_PICKS[case]}
    assert picks == LAN_PICKS[case]


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), rate=st.floats(5e7, 1.5e9), rtt=st.floats(5e-5, 1e-3),
       spread=st.floats(1.0, 1.5), nbytes=st.sampled_from([4096, 1 << 20, 16 << 20]),
       streams=st.sampled_from([0, 1, 4]))
def test_on_a_lan_every_prediction_is_todays(p: int, rate: float, rtt: float, spread: float,
                                             nbytes: int, streams: int) -> None:
    # Round trips within 2 alpha and windows beyond what the line carries in one: the
    # long-path terms add nothing, to any strategy.
    links = tuple(tuple(0.0 if i == j else rate * (spread if (i + j) % 2 else 1.0)
                        for j in range(p)) for i in range(p))
    today = CostModel(TCP, links=links)
    model = replace(today, rtts=matrix(p, rtt), window=WINDOW, streams=streams)
    for entry in registry.entries()["allreduce"].values():
        assert model.predict(entry.strategy, nbytes, p) == today.predict(entry.strategy,
                                                                        nbytes, p)


def test_the_probes_rows_carry_the_least_window() -> None:
    p = 3
    rows = np.full((p, 2 * p + 2), 0.1)
    rows[:, p:2 * p] = 1e8
    rows[:, 2 * p + 1] = [4 << 20, 2 << 20, 3 << 20]
    assert Topology.from_rows(rows).window_bytes == 2 << 20
    assert Topology.from_rows(rows[:, :2 * p + 1]).window_bytes is None  # an older row
    rows[1, 2 * p + 1] = np.nan
    assert Topology.from_rows(rows).window_bytes is None
    assert "window_bytes" not in Topology.from_rows(rows).as_dict()  # g.topology()'s keys


class FakePaths:
    """A transport's paths (:class:`p2pcoll.transport.base.Paths`) of 100 ms to every peer,
    bandwidth not measured, windows of 2 MiB; what it is told, kept."""

    window = WINDOW

    def __init__(self) -> None:
        self.told: list[tuple[int, float | None, float | None]] = []

    def __getitem__(self, peer: int) -> tuple[float | None, float | None]:
        return 0.1, None

    def drive(self, peers: frozenset[int]) -> None:
        pass

    def measure(self, peer: int, rtt_s: float | None = None,
                bandwidth_Bps: float | None = None) -> None:
        self.told.append((peer, rtt_s, bandwidth_Bps))


@pytest.mark.parametrize("streams", ["auto", 1])
def test_price_hands_the_model_the_long_paths(streams: Any) -> None:
    """The probe's rows of the lab: 100 ms round trips, every train read at TCP's
    start-up (2 MB/s), 2 MiB windows. The transport is told nothing (a long path), and the
    model prices the paths as the transport runs them: the assumed rate, the windows, the
    executor's depth of 32, and auto leaves Rabenseifner (the pick of the figures alone)
    for the ring (its windows fill the product) or, one connection a pair, the direct
    exchange (three windows at once)."""
    p = 4
    rows = np.full((p, 2 * p + 2), 0.1)
    rows[:, p:2 * p] = 2e6
    rows[:, 2 * p] = 1.8e9
    rows[:, 2 * p + 1] = WINDOW

    async def main() -> tuple[list[Any], CostModel]:
        groups = await memory_groups(p, probe=False, streams=streams)
        try:
            g = groups[0]
            paths = FakePaths()
            g.session.transport.paths = paths
            topology.price(g, Topology.from_rows(rows))
            return paths.told, g.session.runner.costs()
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    told, model = run_virtual(main())
    assert told == []
    assert model.links == matrix(p, DEFAULT_BANDWIDTH_BPS)
    assert model.rtts == matrix(p, 0.1) and model.window == WINDOW and model.depth == 32
    assert model.streams == (0 if streams == "auto" else 1)
    assert registry.auto_name("allreduce", 64 * MiB, p, model) == (
        "ring" if streams == "auto" else "direct")
    figures = replace(model, links=matrix(p, 2e6), rtts=(), window=0)  # the model before
    assert registry.auto_name("allreduce", 64 * MiB, p, figures) == "rabenseifner"


def test_a_slow_pair_of_short_paths_keeps_its_picks() -> None:
    # benchmarks/slow_pair.py's matrix (1 Gbit/s and 10 ms, pair 0-1 at 100 Mbit/s, the
    # measured ring around it): the windows do not bind, the round trip adds 4.4 ms a step
    # to every strategy, and auto's picks are those before (commit 37482f6).
    p = 4
    links = tuple(tuple(0.0 if i == j else (12e6 if {i, j} == {0, 1} else 125e6)
                        for j in range(p)) for i in range(p))
    model = CostModel(TCP, links=links, ring=(0, 2, 1, 3), rtts=matrix(p, 0.01),
                      window=WINDOW)
    picks = {n: registry.auto_name("allreduce", n, p, model)
             for n in (4096, MiB, 16 * MiB, 64 * MiB)}
    assert picks == {4096: "recursive_doubling", MiB: "ring", 16 * MiB: "ring",
                     64 * MiB: "ring"}
