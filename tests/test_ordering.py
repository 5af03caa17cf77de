"""The socket+lane ordering protocol (p2pcoll.transport.ordering), without sockets or files.

A model of the two channels: the socket is a FIFO with a bounded queue (a send that finds
it full waits, as an asyncio send does, and later sends wait behind it); the lane is a FIFO
of records with a byte capacity that its reader frees as it reads. Messages are
``("msg", n, size)`` and the markers ``("on",)`` / ``("off",)``.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pcoll.errors import ProtocolError
from p2pcoll.transport.ordering import LaneReceiver, LaneSender

ON, OFF = ("on",), ("off",)
MARKER_ROOM = 1


def size_of(message: tuple) -> int:
    return message[2] if message[0] == "msg" else MARKER_ROOM


class Lane:
    """A lane: records in order, ``capacity`` bytes, freed as they are read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: deque[tuple] = deque()
        self.used = 0
        self.corrupt = False

    def fits_now(self, frames: tuple, spare: int = 0) -> bool:
        return self.used + size_of(frames) + spare <= self.capacity

    def write(self, frames: tuple, spare: int = 0) -> bool:
        if not self.fits_now(frames, spare):
            return False
        self.records.append(frames)
        self.used += size_of(frames)
        return True

    def read(self) -> tuple | None:
        if self.corrupt:
            raise ProtocolError("lane from rank 1 is corrupt")
        if not self.records:
            return None
        record = self.records.popleft()
        self.used -= size_of(record)
        return record


class Pair:
    """One sender and its receiver, joined by a socket and a lane (the transport's part)."""

    def __init__(self, lane_bytes: int = 10, socket_room: int = 1000, budget: int = 64,
                 lane_mapped: bool = True) -> None:
        self.lane = Lane(lane_bytes)
        self.queue: deque[tuple] = deque()  # on the socket, not yet read
        self.socket_room = socket_room
        self.waiting: deque[tuple] = deque()  # sends waiting for room in the socket's queue
        self.woken = False
        self.budget = budget
        self.pump_due = False
        self.sent: list[int] = []
        self.delivered: list[int] = []
        self.channels: list[bool] = []  # per delivered message: came on the lane
        self.rejected: list[ProtocolError] = []
        self.sender = LaneSender(
            self.lane, marker_on=ON, marker_off=OFF, marker_room=MARKER_ROOM,
            send_marker=self._send_marker, socket_waiting=lambda: bool(self.waiting),
            wake=self._wake)
        self.receiver: LaneReceiver[tuple, tuple] = LaneReceiver(
            self._accept, self.rejected.append, self.lane if lane_mapped else None)

    # The sender's transport.
    def _send_marker(self, marker: object) -> bool:
        if len(self.queue) >= self.socket_room:
            return False
        self.queue.append(marker)  # type: ignore[arg-type]
        return True

    def _wake(self) -> None:
        self.woken = True

    def send(self, n: int, size: int) -> None:
        message = ("msg", n, size)
        self.sent.append(n)
        if self.sender.put(message):
            return
        if not self.waiting and len(self.queue) < self.socket_room:
            self.queue.append(message)
        else:
            self.waiting.append(message)

    def make_room(self) -> None:
        while self.waiting and len(self.queue) < self.socket_room:
            self.queue.append(self.waiting.popleft())

    # The receiver's transport.
    def _accept(self, message: tuple, on_lane: bool) -> bool | None:
        if message == ON:
            return True
        if message == OFF:
            return False
        self.delivered.append(message[1])
        self.channels.append(on_lane)
        return None

    def read_socket(self) -> None:
        if self.queue:
            self.pump_due |= self.receiver.from_socket(self.queue.popleft(), self.budget)

    def on_wake(self) -> None:
        if self.woken:
            self.woken = False
            if self.receiver.lane_current:
                self.pump_due |= self.receiver.pump(self.budget)

    def run_pump(self) -> None:
        if self.pump_due:
            self.pump_due = self.receiver.pump(self.budget)

    def settle(self) -> None:
        """Run everything until nothing is left to do."""
        for _ in range(100_000):
            if not (self.waiting or self.queue or self.woken or self.pump_due):
                return
            self.make_room()
            self.read_socket()
            self.on_wake()
            self.run_pump()
        raise AssertionError("the pair did not settle")


def test_small_messages_go_on_the_lane_after_one_marker() -> None:
    pair = Pair(lane_bytes=100)
    for n in range(5):
        pair.send(n, 3)
    assert list(pair.queue) == [ON]
    assert len(pair.lane.records) == 5 and pair.sender.on_lane
    pair.settle()
    assert pair.delivered == [0, 1, 2, 3, 4]
    assert pair.channels == [True] * 5
    assert pair.receiver.lane_current


def test_a_message_that_does_not_fit_goes_back_to_the_socket_behind_lane_off() -> None:
    pair = Pair(lane_bytes=10)
    pair.send(0, 4)
    pair.send(1, 4)  # 4 + 4 + room for the marker: 9 <= 10
    pair.send(2, 4)  # does not fit: "lane off" in the room kept for it, then the socket
    assert list(pair.lane.records) == [("msg", 0, 4), ("msg", 1, 4), OFF]
    assert list(pair.queue) == [ON, ("msg", 2, 4)]
    assert not pair.sender.on_lane
    pair.settle()
    assert pair.delivered == [0, 1, 2]
    assert pair.channels == [True, True, False]


def test_socket_messages_are_held_while_the_lane_is_current() -> None:
    pair = Pair(lane_bytes=10)
    pair.send(0, 4)
    pair.read_socket()  # "lane on", then 0 from the lane; the lane stays current
    assert pair.delivered == [0] and pair.receiver.lane_current
    pair.send(1, 20)  # never fits: "lane off" on the lane, then the socket
    pair.send(2, 4)  # to the lane again: "lane on" on the socket
    assert list(pair.queue) == [("msg", 1, 20), ON]
    pair.read_socket()
    pair.read_socket()  # both held: the lane is current until its "lane off" is read
    assert pair.delivered == [0]
    assert list(pair.receiver.held) == [("msg", 1, 20), ON]
    pair.on_wake()  # "lane off", then the held ones: 1, "lane on", then 2 from the lane
    assert pair.delivered == [0, 1, 2]
    assert pair.channels == [True, False, True]
    assert not pair.receiver.held


def test_lane_records_written_before_lane_on_arrives_wait_for_it() -> None:
    pair = Pair(lane_bytes=100)
    pair.send(0, 3)
    pair.send(1, 3)
    pair.on_wake()  # the wake-up comes before the socket's marker: the lane is not current
    assert pair.delivered == []
    pair.read_socket()  # "lane on": read the lane at once
    assert pair.delivered == [0, 1]


def test_no_move_to_the_lane_while_an_earlier_send_waits_for_room() -> None:
    pair = Pair(lane_bytes=100, socket_room=1)
    pair.sender.on_lane = False
    pair.lane.capacity = 0  # first message: no lane room, the socket
    pair.send(0, 3)
    pair.send(1, 3)  # the socket's queue is full: this send waits for room
    assert list(pair.waiting) == [("msg", 1, 3)]
    pair.lane.capacity = 100
    pair.send(2, 3)  # fits the lane, but "lane on" could overtake message 1: socket
    assert not pair.sender.on_lane
    assert list(pair.waiting) == [("msg", 1, 3), ("msg", 2, 3)]
    pair.settle()
    assert pair.delivered == [0, 1, 2]
    assert pair.channels == [False, False, False]


def test_a_full_socket_keeps_the_message_off_the_lane() -> None:
    pair = Pair(lane_bytes=100, socket_room=0)  # "lane on" cannot be sent now
    assert not pair.sender.put(("msg", 0, 3))
    assert not pair.sender.on_lane and not pair.lane.records


def test_room_for_lane_off_is_kept_by_every_write() -> None:
    pair = Pair(lane_bytes=9)
    pair.send(0, 8)  # 8 + 1 kept for the marker
    assert pair.lane.used == 8
    pair.send(1, 1)  # would fill the marker's room: "lane off" takes it
    assert list(pair.lane.records) == [("msg", 0, 8), OFF]
    pair.settle()
    assert pair.delivered == [0, 1]


def test_taken_marker_room_is_a_bug_not_a_lost_message() -> None:
    pair = Pair(lane_bytes=10)
    pair.send(0, 4)
    pair.lane.used = pair.lane.capacity  # something else filled the lane
    with pytest.raises(RuntimeError, match="room kept"):
        pair.sender.put(("msg", 1, 4))


@pytest.mark.parametrize(("marker", "on_lane"), [(ON, True), (OFF, False)])
def test_a_marker_on_the_wrong_channel_is_out_of_turn(marker: tuple, on_lane: bool) -> None:
    pair = Pair()
    if on_lane:
        pair.receiver.from_socket(ON)
        pair.lane.records.append(marker)
        pair.receiver.pump()
        assert pair.receiver.lane_current  # unchanged
    else:
        pair.receiver.from_socket(marker)
        assert not pair.receiver.lane_current
    assert len(pair.rejected) == 1
    assert "out of turn" in str(pair.rejected[0])
    # What comes next is read as before.
    pair.lane.records.append(("msg", 7, 1))
    pair.receiver.pump()
    pair.receiver.from_socket(("msg", 8, 1))
    assert pair.delivered == ([7] if on_lane else [8])


def test_lane_on_without_a_mapped_lane_is_out_of_turn() -> None:
    pair = Pair(lane_mapped=False)
    pair.receiver.from_socket(ON)
    pair.receiver.from_socket(("msg", 0, 1))
    assert not pair.receiver.lane_current
    assert [str(e) for e in pair.rejected] == ["moved to a lane out of turn"]
    assert pair.delivered == [0]


def test_the_receiver_hands_on_at_most_budget_messages_per_call() -> None:
    pair = Pair(lane_bytes=1000, budget=4)
    for n in range(10):
        pair.send(n, 1)
    pair.read_socket()  # "lane on", then 4 from the lane
    assert pair.delivered == [0, 1, 2, 3]
    assert pair.pump_due
    pair.run_pump()
    assert pair.delivered == list(range(8))
    pair.run_pump()
    assert pair.delivered == list(range(10))
    assert not pair.receiver.pump(4)  # nothing left: no pump due


def test_held_messages_are_handed_on_in_bounded_steps() -> None:
    pair = Pair(lane_bytes=10, budget=3)
    pair.send(0, 1)
    pair.read_socket()  # "lane on", 0 from the lane
    for n in range(1, 8):
        pair.send(n, 50)  # "lane off" once, then all on the socket
    for _ in range(7):
        pair.read_socket()
    assert len(pair.receiver.held) == 7 and pair.delivered == [0]
    pair.on_wake()  # "lane off", 1, 2: the budget of 3
    assert pair.delivered == [0, 1, 2] and pair.pump_due
    pair.run_pump()
    assert pair.delivered == [0, 1, 2, 3, 4, 5] and pair.pump_due
    pair.run_pump()
    assert pair.delivered == list(range(8))
    assert not pair.pump_due


def test_a_corrupt_lane_raises_and_is_read_no_more() -> None:
    pair = Pair()
    pair.send(0, 1)
    pair.lane.corrupt = True
    with pytest.raises(ProtocolError, match="corrupt"):
        pair.read_socket()
    assert pair.receiver.lane is None
    assert not pair.receiver.pump()


@settings(max_examples=300, deadline=None)
@given(
    lane_bytes=st.integers(0, 24),
    socket_room=st.integers(0, 4),
    budget=st.integers(1, 5),
    plan=st.lists(
        st.one_of(
            st.tuples(st.just("send"), st.integers(1, 12)),
            st.tuples(st.sampled_from(["socket", "wake", "pump", "room", "lane room"]),
                      st.integers(0, 12)),
        ),
        max_size=80,
    ),
)
def test_delivered_order_is_send_order(lane_bytes: int, socket_room: int, budget: int,
                                       plan: list[tuple[str, int]]) -> None:
    """Any sends, lane room and interleaving of the two channels' deliveries: the
    receiver hands on every message, once, in the order sent, and no marker is rejected."""
    pair = Pair(lane_bytes=lane_bytes, socket_room=socket_room, budget=budget)
    n = 0
    for action, value in plan:
        if action == "send":
            pair.send(n, value)
            n += 1
        elif action == "socket":
            pair.read_socket()
        elif action == "wake":
            pair.on_wake()
        elif action == "pump":
            pair.run_pump()
        elif action == "room":
            pair.make_room()
        else:  # the lane grows or shrinks between sends (other peers' budgets, in effect)
            pair.lane.capacity = max(pair.lane.used + MARKER_ROOM, value)
        assert pair.delivered == pair.sent[:len(pair.delivered)]
    pair.socket_room = max(pair.socket_room, 1)
    pair.settle()
    assert pair.delivered == pair.sent
    assert pair.rejected == []
    assert not pair.receiver.held
