"""The pipeline's window (p2pcoll.engine.window): how many segments of a collective are in
flight over its paths, as a pure function, and the executor's use of it.

- a short path (a LAN, a peer of this host, a path not measured) keeps the default depth;
- a long fat path gets at least its bandwidth-delay product in flight, up to the memory cap
  and the setting's maximum; the longest path of a collective's peers decides;
- an unknown bandwidth counts as the transport's assumed upper bound (never short);
- ``P2PCOLL_PIPELINE_DEPTH`` set is the depth, whatever the paths; unset, the setting is None.
"""

from __future__ import annotations

import math
from array import array
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pcoll.engine.executor import Executor
from p2pcoll.engine.window import MAX_WINDOW_BYTES, bdp_bytes, pipeline_depth
from p2pcoll.settings import Settings
from p2pcoll.settings_env import DEFAULT_PIPELINE_DEPTH, MAX_PIPELINE_DEPTH
from p2pcoll.transport.base import PathsOf
from p2pcoll.transport.paths import DEFAULT_BANDWIDTH_BPS

M = 1 << 20
GBIT = 125e6  # bytes/s of 1 Gbit/s


def test_short_paths_keep_the_default_depth() -> None:
    assert pipeline_depth([], M) == DEFAULT_PIPELINE_DEPTH  # no peer
    assert pipeline_depth([(None, None)], M) == DEFAULT_PIPELINE_DEPTH  # not measured
    assert pipeline_depth([(None, GBIT)], M) == DEFAULT_PIPELINE_DEPTH  # no round trip
    assert pipeline_depth([(50e-6, None)], M) == DEFAULT_PIPELINE_DEPTH  # loopback
    assert pipeline_depth([(0.5e-3, GBIT)], M) == DEFAULT_PIPELINE_DEPTH  # a LAN
    # A round trip that is no number (a clock that jumped) is a path not measured.
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert pipeline_depth([(bad, GBIT)], M) == DEFAULT_PIPELINE_DEPTH


def test_a_long_fat_path_gets_its_bandwidth_delay_product() -> None:
    # 1 Gbit/s, 100 ms: 12.5 MB in flight, 12 segments of 1 MiB.
    depth = pipeline_depth([(0.1, GBIT)], M)
    assert depth == 12 and depth * M >= 0.1 * GBIT
    # The same path in segments of 256 KiB: four times as many.
    assert pipeline_depth([(0.1, GBIT)], M // 4) == 48
    # 300 Mbit/s, 200 ms: 7.5 MB.
    assert pipeline_depth([(0.2, 300e6 / 8)], M) == 8


def test_the_longest_path_of_the_peers_decides() -> None:
    short, long = (1e-3, GBIT), (0.1, GBIT)
    assert pipeline_depth([short, long, (None, None)], M) == pipeline_depth([long], M)


def test_unknown_bandwidth_counts_as_the_assumed_upper_bound() -> None:
    assert bdp_bytes(0.01) == 0.01 * DEFAULT_BANDWIDTH_BPS
    assert bdp_bytes(0.01, None) == bdp_bytes(0.01, 0.0)  # 0 B/s: not measured
    assert pipeline_depth([(0.01, None)], M) == math.ceil(0.01 * DEFAULT_BANDWIDTH_BPS / M)
    # A measured bandwidth below the assumption gives a smaller window, never below the floor.
    assert pipeline_depth([(0.01, GBIT)], M) == DEFAULT_PIPELINE_DEPTH


def test_the_memory_cap_and_the_settings_maximum_bound_the_depth() -> None:
    # 10 Gbit/s assumed at 100 ms: 125 MB, capped at MAX_WINDOW_BYTES.
    assert pipeline_depth([(0.1, None)], M) == MAX_WINDOW_BYTES // M
    # Small segments: the cap would allow thousands; the setting's maximum holds.
    assert pipeline_depth([(0.1, None)], 4 << 10) == MAX_PIPELINE_DEPTH
    # A cap below the floor leaves the floor (a depth asked for is never lowered).
    assert pipeline_depth([(0.1, None)], M, floor=8, cap_bytes=2 * M) == 8
    assert pipeline_depth([(0.1, None)], M, cap_bytes=6 * M) == 6


@given(rtt=st.floats(1e-6, 2.0), bandwidth=st.floats(1e3, 1e11),
       segment=st.integers(1 << 10, 64 << 20), floor=st.integers(1, 16))
def test_the_window_is_the_product_within_its_bounds(rtt: float, bandwidth: float,
                                                     segment: int, floor: int) -> None:
    depth = pipeline_depth([(rtt, bandwidth)], segment, floor=floor)
    top = max(floor, min(MAX_WINDOW_BYTES // segment, MAX_PIPELINE_DEPTH))
    assert floor <= depth <= top
    # At least the product in flight, unless a bound holds it.
    assert depth == top or depth * segment >= rtt * bandwidth
    # Never more than one segment beyond the product, unless the floor asks for it.
    assert depth == floor or (depth - 1) * segment < rtt * bandwidth
    # A longer path never gets a smaller window.
    assert pipeline_depth([(2 * rtt, bandwidth)], segment, floor=floor) >= depth


class _Paths:
    """A transport that knows one path, to every peer (and sends nothing)."""

    send_many = None

    def __init__(self, rtt_s: float | None) -> None:
        self.rtt_s = rtt_s
        self.asked: list[int] = []

        self.paths = PathsOf(self._path)

    def _path(self, peer: int) -> tuple[float | None, float | None]:
        self.asked.append(peer)
        return self.rtt_s, None


class _Program:
    peer = array("B", [1, 2, 1, 2, 3])


def _executor(transport: Any, depth: int | None) -> Executor:
    matcher = SimpleNamespace(get=None)
    return Executor(transport, matcher, None, "g", segment_bytes=M,  # type: ignore[arg-type]
                    depth=depth, max_message_bytes=256 * M)


def test_the_executor_follows_the_paths_unless_the_depth_is_set() -> None:
    long = _Paths(0.1)
    assert _executor(long, None).depth_for(_Program()) == MAX_WINDOW_BYTES // M  # type: ignore[arg-type]
    assert sorted(long.asked) == [1, 2, 3]  # each peer of the program once
    assert _executor(_Paths(None), None).depth_for(_Program()) == DEFAULT_PIPELINE_DEPTH  # type: ignore[arg-type]
    fixed = _Paths(0.1)
    assert _executor(fixed, 2).depth_for(_Program()) == 2  # type: ignore[arg-type]
    assert fixed.asked == []


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, None), ({"P2PCOLL_PIPELINE_DEPTH": "4"}, 4), ({"P2PCOLL_PIPELINE_DEPTH": "32"}, 32)])
def test_the_setting_is_unset_unless_given(environ: dict[str, str], expected: int | None
                                           ) -> None:
    assert Settings.resolve(environ).pipeline_depth == expected
    assert Settings.resolve(environ, pipeline_depth=3).pipeline_depth == 3
