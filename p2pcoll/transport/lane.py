"""Shared-memory lanes: messages between two peers of one host without ZeroMQ's I/O threads.

A small message through libzmq crosses two I/O threads and the receiver's mailbox before
its event loop sees it: about 110 us here for a 4 KiB piece, most of a small collective's
time (``benchmarks/README.md``, "Where a 4 KiB allreduce's time goes"). A lane is the
short way between peers of one host: the sender copies the message's frames into a ring
in shared memory that only it writes and only one receiver reads, then writes one byte
into the receiver's wake-up pipe; the receiver's event loop watches that pipe
(``loop.add_reader``) and reads the lane in the callback. One copy, one system call and
one wake-up per message.

Files. A lane is a file in ``/dev/shm`` (``p2pcoll-<pid>-<16 hex>``, mode 0600) created by
its sender when the group forms and named, with the sender's own wake-up pipe, in the
sender's hello to that peer (over the authenticated socket). The receiver opens the pipe,
then maps the lane, checks its header (the sender's rank, the group, itself as the
reader), marks it mapped and unlinks the name at once; a lane whose receiver never maps
it goes when its sender closes, and what a killed sender leaves is removed by the next
group's :func:`p2pcoll.transport.shm.sweep`. Each peer has one wake-up pipe, an anonymous
pipe that every lane sender of its host writes into (see :class:`Wakeup`).

Records. The lane's data area is a byte ring; ``head`` (bytes written, a running count)
belongs to the sender, ``tail`` (bytes read) to the receiver, both in the header page. A
record is ``size: u32, count: u32, count x length: u32``, then the frames back to back,
padded to 8 bytes; ``size`` :data:`WRAP` means "continue at the ring's start". A record
larger than half the ring is never written (the message goes over the socket). The
receiver checks every length against the ring before it reads: a lane whose record does
not add up is dropped whole (:class:`~p2pcoll.errors.ProtocolError`) and never read again.

Order with the socket is kept by the mesh (``zmq_mesh``), not here: a sender moves a
peer's messages between socket and lane only with a marker on the channel it leaves, and
the receiver follows the markers.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from ..errors import ProtocolError
from . import gil_held
from .shmfile import PAGE, ShmFile
from .shmfile import barrier as _barrier

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

log = logging.getLogger("p2pcoll.transport")

# The data area of one lane (one per ordered pair of a host's peers): LANE_BYTES, less with
# many peers on the host so that a peer's lanes take at most LANE_BUDGET (their space is
# reserved in /dev/shm), but never under MIN_LANE_BYTES.
LANE_BYTES = 256 << 10
MIN_LANE_BYTES = 64 << 10
LANE_BUDGET = 4 << 20
# Lanes open only between peers that talk (when the first hello goes out), each way at most
# this many per peer: the /dev/shm they reserve and the wake-up pipes they hold stay bounded
# however many peers the host has; beyond, messages go over the sockets.
# (Each lane's map holds a descriptor, and each lane in a wake-up pipe's.)
MAX_LANES = 8
WRAP = 0xFFFFFFFF  # a record size that means: the next record is at the ring's start
MAX_FRAMES = 1024  # frames of one record (a header and its payload pieces)
MAX_LANE_BYTES = 1 << 30  # a lane file announced as larger is refused before it is mapped
# The header page, int64 words: the sizes and owners, then the two running counts.
HEAD_BYTES, SIZE, CREATOR, READER, TAG, HEAD, TAIL, MAPPED = range(8)
_U32 = struct.Struct("<I")
_TWO = struct.Struct("<II")


# A record as read: its first frame (a view into the lane, valid until the next read) and
# copies of the others.
Record = tuple[memoryview, list[bytes]]


def _record_size(lengths: Sequence[int]) -> int:
    return (8 + 4 * len(lengths) + sum(lengths) + 7) & ~7


def frames_of(data: memoryview, at: int, lengths: Sequence[int]) -> Record:
    """The frames of a record (``size, count, lengths``, then the frames back to back: the
    layout of both kinds of lane, this one's and :mod:`.tcp_lane`'s) whose frames start
    at ``at`` in ``data``: the first a view into ``data``, copies of the others."""
    first = data[at:at + lengths[0]]
    at += lengths[0]
    rest = []
    for n in lengths[1:]:
        rest.append(bytes(data[at:at + n]))
        at += n
    return first, rest


class LaneOut:
    """The sending end of a lane: records into a ring only this peer writes."""

    def __init__(self, creator: int, reader: int, tag: int, size: int = LANE_BYTES) -> None:
        """Create the lane file (see :meth:`.shmfile.ShmFile.create`).

        Raises:
            OSError: ``/dev/shm`` is full or unusable (nothing is left behind).
        """
        self._file = ShmFile.create(PAGE + size)
        self.name, self.path = self._file.name, self._file.path
        self.size = size
        self.largest = size // 2  # records above this go over the socket
        self._words = np.frombuffer(self._file.map, np.int64, count=8)
        self._words[:5] = (PAGE, size, creator, reader, tag)
        self._data = memoryview(self._file.map)[PAGE:]
        self.head = 0
        self.closed = False

    @property
    def mapped(self) -> bool:
        """Whether the receiver has mapped the lane (only then may it carry messages)."""
        return not self.closed and bool(self._words[MAPPED])

    def room(self) -> int:
        """Bytes free in the ring now."""
        return self.size - (self.head - int(self._words[TAIL]))

    def _skip(self, need: int, spare: int) -> int | None:
        """The bytes to skip to the ring's start before a record of ``need`` bytes, or
        None if it does not fit now with room for a record of ``spare`` after it
        (wherever the ring's end puts that one)."""
        if self.closed or need > self.largest:
            return None
        size = self.size
        pos = self.head % size
        skip = size - pos if pos + need > size else 0
        after = ((0 if skip else pos) + need) % size
        wrap_spare = size - after if spare and after + spare > size else 0
        if skip + need + wrap_spare + spare > self.room():
            return None
        return skip

    def fits_now(self, frames: Sequence[Buffer], spare: int = 0) -> bool:
        """Whether :meth:`write` of ``frames`` with ``spare`` would succeed now."""
        return self._skip(record_size(frames), spare) is not None

    def write(self, frames: Sequence[Buffer], spare: int = 0) -> bool:
        """Append one record of ``frames`` (bytes-like, C-contiguous) and keep room for a
        record of ``spare`` bytes after it; False (nothing written) if it does not fit
        now (see :meth:`fits_now`)."""
        views = [memoryview(f).cast("B") for f in frames]
        lengths = [v.nbytes for v in views]
        need = _record_size(lengths)
        skip = self._skip(need, spare)
        if skip is None:
            return False
        size = self.size
        pos = self.head % size
        _barrier()  # the receiver's tail is read before the bytes it freed are overwritten
        data = self._data
        if skip:
            _U32.pack_into(data, pos, WRAP)
            self.head += skip
            pos = 0
        _TWO.pack_into(data, pos, need, len(views))
        at = pos + 8
        struct.pack_into(f"<{len(lengths)}I", data, at, *lengths)
        at += 4 * len(lengths)
        for view, n in zip(views, lengths, strict=True):
            data[at:at + n] = view
            at += n
        _barrier()  # the record is in memory before the sender's head says so
        self.head += need
        self._words[HEAD] = self.head
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self._words
        self._data.release()
        self._file.close()  # and the name, unless the receiver unlinked it already


class LaneIn:
    """The receiving end of a lane: reads and checks the records of one peer."""

    def __init__(self, name: str, me: int, creator: int, tag: int) -> None:
        """Map the lane ``name`` that rank ``creator`` of the group tagged ``tag`` announced
        to ``me``, and unlink its name (nobody else may map it).

        Raises:
            ProtocolError: not a p2pcoll name, cannot be opened or mapped, or its header
                is not that of ``creator``'s lane to ``me`` in this group.
        """
        self._file = lane = ShmFile.open(name, "lane", min_size=PAGE + 8,
                                         max_size=PAGE + MAX_LANE_BYTES)
        words = np.frombuffer(lane.map, np.int64, count=8)
        page, size, owner, reader, owner_tag = (int(v) for v in words[:5])
        if (page != PAGE or size <= 0 or size % 8 or page + size != lane.size
                or owner != creator or reader != me or owner_tag != tag
                or words[HEAD] != 0 or words[TAIL] != 0):
            del words
            lane.close()
            raise ProtocolError(f"lane {lane.name!r} is not rank {creator}'s lane to rank {me} "
                                f"of this group")
        self.name = lane.name
        self.creator = creator
        self.size = size
        self._words = words
        self._data = memoryview(lane.map)[PAGE:]
        self.tail = 0
        self.broken = False
        lane.unlink()  # nobody else may map it
        _barrier()
        words[MAPPED] = 1

    def read(self) -> Record | None:
        """The next record's first frame (a view, valid until the next call) and copies of
        the others, or None when the lane is empty.

        Raises:
            ProtocolError: the record does not fit the ring or its lengths do not add up;
                the lane is broken and reads nothing more.
        """
        if self.broken:
            return None
        head = int(self._words[HEAD])
        _barrier()  # the bytes before head are read after head itself
        size, data = self.size, self._data
        while self.tail < head:
            pos = self.tail % size
            record = _U32.unpack_from(data, pos)[0]
            if record == WRAP:
                self.tail += size - pos
                continue
            count = _U32.unpack_from(data, pos + 4)[0]
            if (record < 8 or record % 8 or pos + record > size or self.tail + record > head
                    or count < 1 or count > MAX_FRAMES or 8 + 4 * count > record):
                self._corrupt(f"record of {record} bytes with {count} frames at {pos}")
            lengths = struct.unpack_from(f"<{count}I", data, pos + 8)
            at = pos + 8 + 4 * count
            if at + sum(lengths) > pos + record:
                self._corrupt(f"frames of {sum(lengths)} bytes in a record of {record}")
            self.tail += record
            return frames_of(data, at, lengths)
        return None

    def release(self) -> None:
        """Publish that everything read so far may be overwritten."""
        _barrier()
        self._words[TAIL] = self.tail

    def _corrupt(self, what: str) -> NoReturn:
        self.broken = True
        raise ProtocolError(f"lane from rank {self.creator} is corrupt ({what}); it is no "
                            f"longer read")

    def close(self) -> None:
        self.broken = True
        del self._words
        try:
            self._data.release()
        except BufferError:  # a first frame's view is still alive; the GC unmaps it
            pass
        self._file.close()


class Wakeup:
    """A peer's wake-up pipe: its lane senders write a byte into it after a record.

    An anonymous pipe, so that nothing is left on disk: a sender opens the writing end
    through ``/proc/<pid>/fd/<fd>`` (its :attr:`name`), and checks the inode it gets, so
    that a pid of another pid namespace can never lead it to some other process's pipe.
    """

    def __init__(self) -> None:
        self.fd, self._writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        ino = os.fstat(self._writer).st_ino
        self.name = f"{os.getpid()}:{self._writer}:{ino}"

    def clear(self) -> None:
        """Take every byte waiting, so that the next write wakes the loop again."""
        try:
            while len(os.read(self.fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._writer)


_WAKE = re.compile(r"([1-9][0-9]{0,9}):([0-9]{1,9}):([0-9]{1,20})")


class Waker:
    """The writing end of another peer's wake-up pipe."""

    def __init__(self, name: str) -> None:
        """Open the pipe a peer named ``pid:fd:inode`` (see :class:`Wakeup`).

        Raises:
            ProtocolError: not such a name, or no pipe of this user with that inode there
                (another pid namespace, a process gone, ``/proc`` not readable).
        """
        match = _WAKE.fullmatch(name)
        if match is None:
            raise ProtocolError(f"wake-up pipe {name!r} is not pid:fd:inode")
        pid, fd, ino = (int(v) for v in match.groups())
        try:
            self.fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise ProtocolError(f"cannot open wake-up pipe {name!r}: {exc}") from None
        info = os.fstat(self.fd)
        if not stat.S_ISFIFO(info.st_mode) or info.st_ino != ino or info.st_uid != os.geteuid():
            os.close(self.fd)
            raise ProtocolError(f"{name!r} is not that peer's wake-up pipe (another pid "
                                f"namespace?)")

    def wake(self) -> None:
        try:
            gil_held.write_byte(self.fd)  # the GIL kept: see .gil_held
        except BlockingIOError:  # full: the reader has wake-ups enough waiting
            pass
        except OSError as exc:  # its reader is gone; the peer's loss is seen elsewhere
            log.debug("wake-up not written: %s", exc)

    def close(self) -> None:
        os.close(self.fd)


def record_size(frames: Sequence[Buffer]) -> int:
    """Bytes of the ring a record of ``frames`` takes."""
    return _record_size([memoryview(f).nbytes for f in frames])


class Lanes:
    """A peer's lanes to and from the other peers of its host, and its wake-up pipe."""

    def __init__(self, rank: int, peers: set[int], tag: int, size: int | None = None) -> None:
        """Create the wake-up pipe; a lane to one of ``peers``, of ``size`` bytes (by
        default :data:`LANE_BYTES`, or :data:`LANE_BUDGET` shared by them, not under
        :data:`MIN_LANE_BYTES`), is made when the hello to it is (:meth:`announce`).

        Raises:
            OSError: the wake-up pipe cannot be made.
        """
        self.rank, self.peers, self.tag = rank, peers, tag
        self.marker_room = 0  # ring bytes a sender keeps free for its "lane off" marker
        self.into: dict[int, LaneIn] = {}
        self.out: dict[int, LaneOut] = {}
        self._wakers: dict[int, Waker] = {}
        self._ready: dict[int, LaneOut] = {}
        if size is None:
            size = min(LANE_BYTES, max(MIN_LANE_BYTES,
                                       LANE_BUDGET // max(1, min(len(peers), MAX_LANES))))
            size -= size % 8
        self.size = size
        self.wakeup = Wakeup()

    def announce(self, peer: int) -> dict[str, str]:
        """What the hello to ``peer`` names: my lane to it (made now, the first time: lanes
        exist only between peers that talk) and my wake-up pipe; nothing once this peer
        has :data:`MAX_LANES` lanes.

        Raises:
            OSError: ``/dev/shm`` is full or unusable (no lane to ``peer`` then).
        """
        out = self.out.get(peer)
        if out is None:
            if len(self.out) >= MAX_LANES:
                return {}  # over the budget: messages to this peer go over the socket
            out = self.out[peer] = LaneOut(self.rank, peer, self.tag, self.size)
        return {"lane": out.name, "wake": self.wakeup.name}

    def accept(self, peer: int, lane_name: object, wake_name: object) -> None:
        """Open ``peer``'s wake-up pipe and map its lane to me, in that order (a mapped
        lane tells its sender that it may wake me).

        Raises:
            ProtocolError: not a peer of this host, announced twice, or the names are not
                a lane of ``peer`` to me and a wake-up pipe of this user.
        """
        if peer not in self.peers or peer in self.into:
            raise ProtocolError(f"rank {peer} may not announce a lane here")
        if len(self.into) >= MAX_LANES:
            raise ProtocolError(f"{MAX_LANES} lanes come here already (the budget)")
        if not isinstance(lane_name, str) or not isinstance(wake_name, str):
            raise ProtocolError(f"lane {lane_name!r} and wake-up pipe {wake_name!r} are not "
                                f"names")
        waker = Waker(wake_name)
        try:
            self.into[peer] = LaneIn(lane_name, self.rank, peer, self.tag)
        except BaseException:
            waker.close()
            raise
        self._wakers[peer] = waker

    def ready(self, peer: int) -> LaneOut | None:
        """My lane to ``peer`` if it may carry messages: the peer mapped it and I can wake
        it; else None."""
        out = self._ready.get(peer)
        if out is not None:
            return out
        out = self.out.get(peer)
        if out is None or peer not in self._wakers or not out.mapped:
            return None
        self._ready[peer] = out
        return out

    def wake(self, peer: int) -> None:
        self._wakers[peer].wake()

    def close(self) -> None:
        for out in self.out.values():
            out.close()
        for inbound in self.into.values():
            inbound.close()
        for waker in self._wakers.values():
            waker.close()
        self.out.clear()
        self.into.clear()
        self._wakers.clear()
        self._ready.clear()
        self.wakeup.close()


__all__ = ["LANE_BYTES", "LaneIn", "LaneOut", "Lanes", "Record", "Waker", "Wakeup",
           "record_size"]
