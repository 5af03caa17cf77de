"""The heal from every survivor (p2pcoll.training.heal) over the in-memory transport: the
striped plan, bit-identical state, a corrupted range refetched and its sender named, an
outvoted source, a sender lost mid-transfer (resumed from the survivors), every sender lost,
and every range in flight ending with the group's error, retrieved."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import os
import threading
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import memory_groups
from p2pcoll.transport.memory import MemoryTransport
from p2pcoll.training.heal import (HealFailed, HealProgress, StripedHeal, _in_background, heal,
                                  plan_ranges)

TIMEOUT = 10.0
CHUNK = 1000  # bytes a range: a few KiB of state makes a dozen ranges


def state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((37, 29)).astype(np.float32),
            "b": rng.standard_normal(7),  # float64: ranges cross leaves of other dtypes
            "steps": np.arange(5, dtype=np.int64) * (seed + 1),
            "empty": np.zeros(0, np.float32)}


def digest(tree: Any) -> str:
    h = hashlib.sha256()
    for name, leaf in training.named_leaves(tree):
        h.update(name.encode())
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


async def close(groups: list[p2pcoll.Group]) -> None:
    for group in groups:
        await group.close()


def test_plan_ranges_cut_the_bytes_in_order_across_leaves() -> None:
    assert plan_ranges([], 4) == []
    assert plan_ranges([0, 3, 6], 4) == [[(1, 0, 3), (2, 0, 1)], [(2, 1, 5)], [(2, 5, 6)]]
    ranges = plan_ranges([10, 0, 7, 9], 5)
    covered = [piece for pieces in ranges for piece in pieces]
    assert sum(b - a for _, a, b in covered) == 26
    assert all(sum(b - a for _, a, b in pieces) == 5 for pieces in ranges[:-1])


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        StripedHeal(chunk_bytes=0)

    async def run() -> None:
        groups = await memory_groups(2)
        try:
            with pytest.raises(ValueError, match="sources"):
                await heal(groups[0], state(0), [])
            with pytest.raises(ValueError, match="sources"):
                await heal(groups[0], state(0), [2])
            with pytest.raises(ValueError, match="twice"):
                await heal(groups[0], state(0), [0, 0])
            frozen = state(0)
            frozen["w"].flags.writeable = False
            with pytest.raises(ValueError, match="'w' is read-only"):
                await heal(groups[1], frozen, [0])
        finally:
            await close(groups)

    asyncio.run(run())


@pytest.mark.parametrize(("p", "sources"), [(2, [0]), (4, [0, 1, 2]), (5, [1, 3]),
                                            (4, [0, 1, 2, 3])])
async def test_every_receiver_ends_bit_identical_with_the_sources(
        p: int, sources: list[int]) -> None:
    groups = await memory_groups(p, collective_timeout=TIMEOUT)
    trees = [state(0) if r in sources else state(r + 10) for r in range(p)]
    own = [dict(t) for t in trees]  # the receivers' own arrays are written into
    try:
        reports = await asyncio.gather(*(heal(g, t, sources, chunk_bytes=CHUNK)
                                         for g, t in zip(groups, trees, strict=True)))
    finally:
        await close(groups)
    want = digest(state(0))
    assert [digest(t) for t in trees] == [want] * p
    for tree, mine in zip(trees, own, strict=True):
        assert all(tree[k] is mine[k] for k in tree)
    n = len(plan_ranges([a.nbytes for _, a in training.named_leaves(state(0))], CHUNK))
    for r, report in enumerate(reports):
        assert report.sources == sources and report.bad == [] and report.refetched == 0
        receiving = r not in sources
        assert report.received == (n if receiving else 0)
        assert report.passes == (1 if len(sources) < p else 0)


async def test_each_source_sends_its_own_stripe() -> None:
    """Three sources, one receiver: each source's sends are a third of the ranges."""
    sent: dict[int, list[int]] = {}

    class Counting(StripedHeal):
        async def send_range(self, group: p2pcoll.Group, dst: int, index: int,
                             pieces: list[np.ndarray]) -> None:
            sent.setdefault(group.rank, []).append(index)
            await super().send_range(group, dst, index, pieces)

    groups = await memory_groups(4, collective_timeout=TIMEOUT)
    try:
        await asyncio.gather(*(Counting(chunk_bytes=CHUNK).run(g, state(0 if g.rank < 3 else 9),
                                                               [0, 1, 2]) for g in groups))
    finally:
        await close(groups)
    n = sum(len(v) for v in sent.values())
    assert sorted(sent) == [0, 1, 2]
    assert sorted(i for v in sent.values() for i in v) == list(range(n))
    assert all(abs(len(v) - n / 3) < 1 for v in sent.values())
    assert sent[0] == sorted(sent[0]) and max(sent[0]) < min(sent[1]) < min(sent[2])


class Corrupting(StripedHeal):
    """A source that flips a byte of every range it sends, holding the right state (so its
    digests are the majority's): the receiver's check is what catches it."""

    def __init__(self, liar: int) -> None:
        super().__init__(chunk_bytes=CHUNK, timeout=TIMEOUT)
        self.liar = liar

    async def send_range(self, group: p2pcoll.Group, dst: int, index: int,
                         pieces: list[np.ndarray]) -> None:
        if group.rank == self.liar:
            pieces = [piece.copy() for piece in pieces]
            pieces[0][0] ^= 0xFF
        await super().send_range(group, dst, index, pieces)


async def test_a_corrupted_range_is_fetched_elsewhere_and_its_sender_named(
        caplog: pytest.LogCaptureFixture) -> None:
    groups = await memory_groups(4, collective_timeout=TIMEOUT)
    trees = [state(0), state(0), state(0), state(5)]
    try:
        with caplog.at_level(logging.WARNING, "p2pcoll.training"):
            reports = await asyncio.gather(*(Corrupting(liar=1).run(g, t, [0, 1, 2])
                                             for g, t in zip(groups, trees, strict=True)))
    finally:
        await close(groups)
    assert digest(trees[3]) == digest(state(0))
    for report in reports:
        assert report.bad == [1] and report.passes == 2 and report.refetched > 0
    assert "rank 1 sent range" in caplog.text and "do not match the agreed digest" in caplog.text


async def test_a_range_no_source_sends_intact_fails_and_the_receiver_keeps_its_state() -> None:
    groups = await memory_groups(2, collective_timeout=TIMEOUT)
    trees = [state(0), state(5)]
    try:
        errors = await asyncio.gather(*(Corrupting(liar=0).run(g, t, [0])
                                        for g, t in zip(groups, trees, strict=True)),
                                      return_exceptions=True)
    finally:
        await close(groups)
    for exc in errors:
        assert isinstance(exc, HealFailed) and exc.bad == [0], exc
        assert "no source sent range 0 intact to rank 1" in str(exc)
    assert digest(trees[1]) == digest(state(5))  # nothing of it applied


async def test_a_source_holding_other_bytes_is_outvoted(
        caplog: pytest.LogCaptureFixture) -> None:
    groups = await memory_groups(4, collective_timeout=TIMEOUT)
    wrong = state(0)
    wrong["w"].flat[500] += 1.0  # in range 2 of 5, one of rank 1's own stripe
    trees = [state(0), wrong, state(0), state(5)]
    try:
        with caplog.at_level(logging.WARNING, "p2pcoll.training"):
            reports = await asyncio.gather(*(heal(g, t, [0, 1, 2], chunk_bytes=CHUNK)
                                             for g, t in zip(groups, trees, strict=True)))
    finally:
        await close(groups)
    assert digest(trees[3]) == digest(state(0))
    # Its range went out with the first pass (the vote comes meanwhile): refetched.
    assert all(r.bad == [1] and r.passes == 2 and r.refetched == 1 for r in reports)
    assert "source(s) [1] hold other bytes" in caplog.text


async def test_two_sources_that_disagree_are_a_heal_failed_before_anything_moves() -> None:
    groups = await memory_groups(3, collective_timeout=TIMEOUT)
    trees = [state(0), state(1), state(5)]
    try:
        errors = await asyncio.gather(*(heal(g, t, [0, 1], chunk_bytes=CHUNK)
                                        for g, t in zip(groups, trees, strict=True)),
                                      return_exceptions=True)
    finally:
        await close(groups)
    assert all(isinstance(e, HealFailed) and "no majority" in str(e) for e in errors), errors
    assert digest(trees[2]) == digest(state(5))


class Dying(StripedHeal):
    """Source ``victim`` vanishes (its link cut, as a crash) after sending ``after`` ranges."""

    def __init__(self, victims: set[int], after: int) -> None:
        super().__init__(chunk_bytes=CHUNK, timeout=TIMEOUT)
        self.victims, self.after, self.sent = victims, after, 0

    async def send_range(self, group: p2pcoll.Group, dst: int, index: int,
                         pieces: list[np.ndarray]) -> None:
        if group.rank in self.victims and self.sent == self.after:
            transport = group.session.transport
            assert isinstance(transport, MemoryTransport)
            transport.network.cut(group.endpoint)
            await group.close()
        self.sent += 1
        await super().send_range(group, dst, index, pieces)


async def test_a_sender_lost_mid_transfer_ends_every_range_in_flight_and_the_heal_resumes(
) -> None:
    """Rank 1 of three sources dies after one range: every rank's heal ends with the group's
    error (retrieved), the receiver's state is untouched and its progress keeps what it
    received; the survivors, in a new group, send only the rest, and the receiver ends
    bit-identical."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    groups = await memory_groups(4, collective_timeout=TIMEOUT, heartbeat_timeout=1.0)
    trees = [state(0), state(0), state(0), state(5)]
    progress = HealProgress()

    async def rank(g: p2pcoll.Group, tree: Any) -> BaseException | None:
        try:
            await Dying({1}, after=1).run(g, tree, [0, 1, 2],
                                          progress if g.rank == 3 else None)
        except p2pcoll.P2PCollError as exc:
            return exc
        return None

    try:
        errors = await asyncio.gather(*(rank(g, t) for g, t in zip(groups, trees, strict=True)))
    finally:
        await close(groups)
    for r in (0, 2, 3):
        assert isinstance(errors[r], (p2pcoll.PeerLost, p2pcoll.GroupBroken)), errors[r]
    assert isinstance(errors[3], p2pcoll.PeerLost) and errors[3].rank == 1
    assert digest(trees[3]) == digest(state(5))  # nothing applied
    verified = set(progress.held)
    assert verified  # ranks 0 and 2 sent theirs meanwhile

    survivors = await memory_groups(3, collective_timeout=TIMEOUT)  # ranks 0, 2 and 3
    again = [trees[0], trees[2], trees[3]]
    try:
        reports = await asyncio.gather(*(heal(g, t, [0, 1], progress=progress if g.rank == 2
                                              else None, chunk_bytes=CHUNK)
                                         for g, t in zip(survivors, again, strict=True)))
    finally:
        await close(survivors)
    assert digest(trees[3]) == digest(state(0))
    assert reports[2].resumed == len(verified)
    assert reports[2].received == reports[2].ranges - len(verified)
    del errors, groups, survivors
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0)
    assert not unretrieved, [str(c.get("exception")) for c in unretrieved]


async def test_every_sender_lost_is_the_groups_error_and_the_receiver_keeps_its_state(
) -> None:
    groups = await memory_groups(3, collective_timeout=TIMEOUT, heartbeat_timeout=1.0)
    trees = [state(0), state(0), state(5)]
    progress = HealProgress()

    async def rank(g: p2pcoll.Group, tree: Any) -> BaseException | None:
        try:
            await Dying({0, 1}, after=1).run(g, tree, [0, 1],
                                             progress if g.rank == 2 else None)
        except p2pcoll.P2PCollError as exc:
            return exc
        return None

    try:
        errors = await asyncio.gather(*(rank(g, t) for g, t in zip(groups, trees, strict=True)))
    finally:
        await close(groups)
    assert isinstance(errors[2], p2pcoll.PeerLost) and errors[2].rank in (0, 1), errors[2]
    assert digest(trees[2]) == digest(state(5))
    assert len(progress.held) < progress_ranges()


def progress_ranges() -> int:
    return len(plan_ranges([a.nbytes for _, a in training.named_leaves(state(0))], CHUNK))


async def test_two_receivers_and_a_corrupt_source_both_end_bit_identical() -> None:
    groups = await memory_groups(5, collective_timeout=TIMEOUT)
    trees = [state(0), state(0), state(0), state(6), state(7)]
    try:
        reports = await asyncio.gather(*(Corrupting(liar=2).run(g, t, [0, 1, 2])
                                         for g, t in zip(groups, trees, strict=True)))
    finally:
        await close(groups)
    assert [digest(t) for t in trees] == [digest(state(0))] * 5
    assert all(r.bad == [2] for r in reports)


async def test_a_state_of_no_bytes_heals_to_nothing() -> None:
    groups = await memory_groups(2, collective_timeout=TIMEOUT)
    try:
        reports = await asyncio.gather(*(heal(g, {"e": np.zeros((0, 3))}, [0]) for g in groups))
    finally:
        await close(groups)
    assert [r.ranges for r in reports] == [0, 0]


async def test_under_train_elastic_a_receiver_whose_senders_all_died_does_not_start_over(
) -> None:
    """A formation in which nobody holds the state (every member a newcomer) while this
    rank holds ranges of a heal cut short: HealFailed, its state untouched, rather than the
    job starting over from a newcomer's weights."""
    from p2pcoll.training.elastic import _Run

    async def step(group: p2pcoll.Group, r: int, s: Any) -> dict[str, Any]:
        return {}

    groups = await memory_groups(2, collective_timeout=TIMEOUT)
    trees = [state(5), state(6)]
    runs = [_Run(step, lambda s, g, r: None, t, 3, 1.0, {"delay": 0},
                 {"op": "avg", "trim": None, "codec": None},
                 {"rendezvous": "tcp://127.0.0.1:9", "min_world_size": 1}) for t in trees]
    for run in runs:
        run.healing.held = {0: bytes(32)}
    try:
        errors = await asyncio.gather(*(run._sync(g) for run, g in zip(runs, groups,
                                                                       strict=True)),
                                      return_exceptions=True)
    finally:
        await close(groups)
    for exc in errors:
        assert isinstance(exc, HealFailed), exc
        assert "every member that held the state was lost" in str(exc)
    assert [digest(t) for t in trees] == [digest(state(5)), digest(state(6))]


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread niceness is Linux's")
async def test_a_heal_everyone_waits_for_hashes_at_the_process_priority() -> None:
    """A source's hashing yields to training by default (the lowest priority); a heal the
    whole group waits for (train_elastic's formation, ``yielding=False``) does not: on a
    loaded host the lowest priority held every member up for seconds."""
    seen: dict[bool, int] = {}

    def niceness(data: Any, ranges: Any) -> np.ndarray:
        return np.array([os.getpriority(os.PRIO_PROCESS, threading.get_native_id())])

    for yielding in (True, False):
        seen[yielding] = int((await _in_background(niceness, [], [], yielding))[0])
    assert seen == {True: 19, False: os.getpriority(os.PRIO_PROCESS, 0)}


async def test_a_heal_that_does_not_yield_gives_the_same_bits() -> None:
    groups = await memory_groups(3, collective_timeout=TIMEOUT)
    trees = [state(0), state(0), state(12)]
    try:
        await asyncio.gather(*(heal(g, t, [0, 1], chunk_bytes=CHUNK, yielding=False)
                               for g, t in zip(groups, trees, strict=True)))
    finally:
        await close(groups)
    assert [digest(t) for t in trees] == [digest(state(0))] * 3
