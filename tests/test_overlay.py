"""The sparse overlay's arithmetic (p2pcoll.departures.overlay), without sockets: who watches
whom, who greets whom, and that news passed on to each rank's fingers reaches every live
rank within about log2 p hops, with a constant number of watchers per rank at any p."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pcoll.departures import overlay


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 17, 64, 1024])
def test_every_rank_is_watched_by_a_constant_number_of_others(size: int) -> None:
    k = min(overlay.WATCHED, size - 1)
    watched_by: dict[int, set[int]] = {r: set() for r in range(size)}
    for r in range(size):
        mine = overlay.watched(r, size)
        assert len(mine) == len(set(mine)) == k and r not in mine
        for peer in mine:
            watched_by[peer].add(r)
    for r in range(size):
        assert watched_by[r] == set(overlay.watchers(r, size))
        assert len(watched_by[r]) == k


@pytest.mark.parametrize("size", [2, 3, 5, 8, 64, 100, 1024])
def test_fingers_are_log_many_and_distinct(size: int) -> None:
    for r in (0, 1, size - 1):
        f = overlay.fingers(r, size)
        assert len(f) == len(set(f)) <= math.ceil(math.log2(size))
        assert r not in f


def flood(size: int, origin: int, dead: set[int], known: frozenset[int] = frozenset()
          ) -> dict[int, int]:
    """The hop at which each live rank first hears news that ``origin`` spreads, when every
    rank that hears it first passes it to its fingers (dead ranks pass nothing on; the
    ``known`` dead are skipped)."""
    heard = {origin: 0}
    frontier = [origin]
    while frontier:
        nxt = []
        for r in frontier:
            for peer in overlay.fingers(r, size, known):
                if peer not in heard and peer not in dead:
                    heard[peer] = heard[r] + 1
                    nxt.append(peer)
        frontier = nxt
    return heard


@pytest.mark.parametrize("size", [2, 3, 7, 8, 64, 1000, 1024])
def test_news_reaches_everyone_within_log2_p_hops(size: int) -> None:
    for origin in {0, size // 2, size - 1}:
        heard = flood(size, origin, set())
        assert set(heard) == set(range(size))
        assert max(heard.values()) <= math.ceil(math.log2(size))


@given(st.integers(3, 300), st.data())
def test_news_goes_around_ranks_known_dead(size: int, data: st.DataObject) -> None:
    """A watcher spreads the news of the rank it saw die; ranks that died earlier (whose
    news went round before) are skipped, so they do not keep it from any live rank."""
    victim = data.draw(st.integers(0, size - 1))
    earlier = data.draw(st.sets(st.integers(0, size - 1), max_size=size - 2)) - {victim}
    dead = earlier | {victim}
    live_watchers = [w for w in range(size) if w not in dead]
    origin = data.draw(st.sampled_from(live_watchers))
    heard = flood(size, origin, dead, known=frozenset(dead))
    assert set(heard) == set(range(size)) - dead
    assert max(heard.values()) <= math.ceil(math.log2(size))


def test_one_unnoticed_death_on_the_way_is_gone_around() -> None:
    """A second rank dead but not yet known (no news of it yet) costs at most a detour."""
    size = 64
    for unnoticed in range(1, size):
        heard = flood(size, 0, {unnoticed})
        missed = set(range(size)) - {unnoticed} - set(heard)
        assert not missed, (unnoticed, missed)


def test_bad_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 5 is not a rank of a group of 5"):
        overlay.watched(5, 5)
    with pytest.raises(ValueError, match="rank 0 is not a rank of a group of 0"):
        overlay.fingers(0, 0)


@pytest.mark.parametrize("meta, match", [
    (None, "names no rank"),
    ({"rank": 9, "graceful": False}, "not all in this group of 4"),
    ({"rank": 1}, "expected"),
    ({"rank": 1, "graceful": 1}, "expected"),
    ({"rank": 1, "graceful": True, "told": [0, 7]}, "not all in this group of 4"),
    ({"rank": 1, "graceful": True, "told": "all"}, "expected a list of ranks"),
    ({"rank": 1, "graceful": True, "more": 1}, "expected"),
    ({"rank": 1, "graceful": True, "lost": 4}, "not all in this group of 4"),
    ({"rank": 1, "graceful": False, "lost": 3}, "only a goodbye"),
    ({"rank": 1, "graceful": True, "cause": {"q": 0, "err": ["PeerLost", "x"], "rank": 5}},
     "not all in this group of 4"),
])
def test_news_of_a_departure_is_checked_like_any_message(meta: object, match: str) -> None:
    """A "gone" message is input like any other: a rank outside the group, a wrong field
    or type, a failure report on the news of a loss (only a goodbye carries one) is a
    ProtocolError (the message is dropped and counted), never a departure."""
    from p2pcoll.errors import ProtocolError
    from p2pcoll.wire import Header, Limits, encode_header, validate

    h = Header("gone", "g", 2, 0, meta=meta)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=match):
        validate(2, encode_header(h), [], Limits("g", 0, 4, 1 << 20))
