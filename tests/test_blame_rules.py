"""The rules of p2pcoll.session.blame as pure functions, and the OpKey value: no group,
no event loop."""

from __future__ import annotations

import pytest

from p2pcoll.session.blame import follow, inquiry_time, is_found, judge, ranks_text
from p2pcoll.types import OpKey
from p2pcoll.wire import ABSENT, FAILED, FINISHED, NOT_STARTED, OWN, SILENT, WAITING


def test_without_answers_a_rank_blames_whom_it_waits_for() -> None:
    verdict = judge(0, [3])
    assert (verdict.blamed, verdict.rule) == ([3], OWN)
    assert verdict.report == "still waiting for ranks [3]"


def test_a_ring_blames_the_rank_that_did_not_start_not_the_neighbour() -> None:
    # 0 waits for 3, 3 waits for 2, 2 waits for 1, and 1 never called the collective.
    answers = {3: (WAITING, [2]), 2: (WAITING, [1]), 1: (NOT_STARTED, [])}
    verdict = judge(0, [3], answers, asked={1, 2, 3})
    assert (verdict.blamed, verdict.rule) == ([1], ABSENT)
    assert verdict.report.startswith("rank 1 has not started it; waiting: rank 0 for [3], ")


def test_silence_comes_before_absence() -> None:
    answers = {1: (NOT_STARTED, []), 3: (WAITING, [1, 2])}
    verdict = judge(0, [3], answers, asked={1, 2, 3})
    assert (verdict.blamed, verdict.rule) == ([2], SILENT)
    assert verdict.report.startswith("rank 2 did not answer (frozen, overloaded or cut off)")
    assert "not started: rank 1" in verdict.report


def test_of_several_silent_ranks_those_somebody_waits_for_are_blamed() -> None:
    verdict = judge(0, [2], {1: (WAITING, [2])}, asked={1, 2, 3, 4})
    assert (verdict.blamed, verdict.rule) == ([2], SILENT)
    assert "no answer: ranks 3, 4" in verdict.report


def test_silent_ranks_nobody_waits_for_are_blamed_all_the_same() -> None:
    verdict = judge(0, [1], {1: (WAITING, [])}, asked={1, 2, 3})
    assert (verdict.blamed, verdict.rule) == ([2, 3], SILENT)


def test_a_peer_that_left_after_its_part_is_excused_not_silent() -> None:
    answers = {1: (WAITING, [2])}
    verdict = judge(0, [1], answers, asked={1, 2}, excused={2})
    assert verdict.rule != SILENT and verdict.blamed == [1]


def test_a_failed_peer_counts_as_waiting() -> None:
    answers = {1: (FAILED, [2]), 2: (NOT_STARTED, []), 3: (FINISHED, [])}
    verdict = judge(0, [1], answers, asked={1, 2, 3})
    assert (verdict.blamed, verdict.rule) == ([2], ABSENT)
    assert "rank 1 for [2] (failed)" in verdict.report and "finished: rank 3" in verdict.report


def test_everyone_answering_and_waiting_blames_this_ranks_own_view() -> None:
    answers = {1: (WAITING, [0]), 2: (WAITING, [1])}
    verdict = judge(0, [2], answers, asked={1, 2})
    assert (verdict.blamed, verdict.rule) == ([2], OWN)


def test_a_peer_follows_a_timeout_that_found_the_ranks_and_keeps_its_own_view_otherwise() -> None:
    assert follow(SILENT, [4], [1]) == [4]
    assert follow(ABSENT, [2, 3], []) == [2, 3]
    assert follow(OWN, [4], [1]) == [1]
    assert follow(OWN, [4], []) == [4]
    assert is_found(SILENT) and is_found(ABSENT) and not is_found(OWN)


@pytest.mark.parametrize(("limit", "wait"), [(0.05, 0.1), (0.5, 0.25), (10.0, 1.0)])
def test_the_inquiry_is_short_against_the_deadline(limit: float, wait: float) -> None:
    assert inquiry_time(limit) == wait


def test_ranks_text() -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([1, 4]) == "ranks 1, 4"


def test_op_keys_are_frozen_values_that_tell_collectives_from_transfers() -> None:
    collective, transfer = OpKey(3), OpKey.transfer(0, 1, 7, 3)
    assert collective == OpKey(3) and hash(collective) == hash(OpKey(3))
    assert collective != transfer and transfer == OpKey.transfer(0, 1, 7, 3)
    assert not collective.is_transfer and collective.channel is None
    assert transfer.is_transfer and transfer.channel == (0, 1, 7)
    assert (transfer.number, transfer.tag, transfer.src, transfer.dst) == (3, 7, 0, 1)
    assert collective.title("allreduce") == "allreduce #3"
    assert transfer.title("send") == "send #3 from rank 0 to rank 1 with tag 7"
    with pytest.raises(AttributeError):
        transfer.number = 4  # type: ignore[misc]
