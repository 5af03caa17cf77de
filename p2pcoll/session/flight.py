"""The flight recorder: each group's last calls, kept to say after a hang or a failure
what every rank was doing.

The session's runner (:meth:`p2pcoll.session.calls.Runner.run`, the one path every call
takes) enters a call when it ends, as one tuple appended to :attr:`Recorder.calls`, a deque
of the last ``P2PCOLL_FLIGHT_RECORD`` calls (2,000; 0: off) that drops the oldest: its
number, what it is (collective, strategy, bytes, dtypes, shapes: an :data:`Entry` made once
per prepared program, the very object), its start and end (the runner's own clock reads)
and the strategy it ran with. Everything else (wall-clock times, names, lists) is made
when the record is read; a failed call goes through :meth:`Recorder.record`, which keeps
whom its error blames and writes the folder. The calls still running are not written
anywhere: the failure model lists them
(:meth:`~p2pcoll.session.failure.FailureModel.calls`, its table of running operations, each
with its entry and start) and :meth:`Recorder.snapshot` reads them there, however long they
run. Nor is what a running call still waits for kept as it changes: the snapshot asks the
matcher (the answer a timeout's inquiry gets, see :mod:`p2pcoll.session.blame`).

``P2PCOLL_FLIGHT_DIR=DIR``: each rank writes its record to ``DIR/rank-R.json`` when a call
fails (a timeout, a mismatch, a lost peer), or its group is found broken, and on SIGUSR1
(:func:`arm_signal`). The snapshot is taken on the loop; the JSON is encoded and written
(to a temporary file, then renamed: a reader never sees half a file) on a worker thread, so
the loop is held for the snapshot only. ``p2pcoll flight DIR`` reads the files
(:mod:`p2pcoll.flight`).

A process with several groups of one rank number (torch's subgroups) writes one file per
rank: the group that wrote last wins.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any, Protocol

import numpy as np

from ..errors import CollectiveTimeout, PeerLost
from ..types import OpKey

log = logging.getLogger("p2pcoll")

FORMAT = "p2pcoll-flight"  # a file's "format" field: p2pcoll.flight refuses others
VERSION = 1
RUNNING, DONE, FAILED = "running", "done", "failed"

Waiting = Callable[[OpKey], list[int]]  # the ranks a running operation waits for
# The calls running now: each one's key, Entry (or None: not described) and start.
Running = Callable[[], Iterable[tuple[OpKey, Any, float]]]
Shapes = tuple[tuple[int, ...], ...]  # one shape per array leaf
# What a call is, as its entry says: (collective, strategy, bytes, dtypes, shapes); made
# once per prepared program (see p2pcoll.session.calls.Prepared.flight).
Entry = tuple[str, str, int, str, Shapes]
# One ended call: its number, entry, start and end (time.perf_counter()) and the strategy it
# ran with ("": its entry's); a failed call's has the ranks its error names after them.
Row = tuple[int, Entry, float, float, str] | tuple[int, Entry, float, float, str, tuple[int, ...]]


_NAMES: dict[np.dtype[Any], str] = {}  # dtype -> "float32": dtype.name is slow to compute


def describe(arrays: Sequence[np.ndarray], leaves: Sequence[np.ndarray]
             ) -> tuple[int, str, Shapes]:
    """The bytes of ``arrays`` (the data as it moves, flattened), their dtypes' names
    (``"float32"``, ``"float32,int64"`` for several kinds; ``""`` for none) and the shapes
    of ``leaves`` (the same data as the caller passed it)."""
    names: list[str] = []
    nbytes = 0
    for a in arrays:
        nbytes += a.nbytes
        name = _NAMES.get(a.dtype)
        if name is None:
            name = _NAMES[a.dtype] = a.dtype.name
        if name not in names:
            names.append(name)
    return nbytes, ",".join(names), tuple(a.shape for a in leaves)


class Recorder:
    """The flight record of one group on this rank.

    Args:
        size: how many ended calls it keeps (> 0).
        rank, world_size, group: what the files say about the rank that wrote them.
        waiting: the ranks a running operation waits for (the session's matcher's).
        waited: the ranks a failed collective waited for when it failed (the failure
            model's), for an error that names nobody.
        folder: where :meth:`dump` writes ``rank-R.json`` ("" : it does not).
        running: the calls running now (the failure model's, see the module docstring).
    """

    def __init__(self, size: int, rank: int, world_size: int, group: str, waiting: Waiting,
                 waited: Waiting, folder: str = "", running: Running = tuple) -> None:
        self.size = size
        # The ended calls, oldest first, one Row each (see the module docstring): the
        # runner appends a call that did not fail itself, the whole of its cost while on.
        # A row holds ints, floats, strings and its program's entry: tuples of those,
        # which the garbage collector stops following once it has passed them (an object
        # or an OpKey per row would be followed for as long as it is kept: 2,000 of them
        # cost each call about a microsecond in collections).
        self.calls: deque[Row] = deque(maxlen=size)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.folder = folder
        self._waiting, self._waited_for, self._running = waiting, waited, running
        # perf_counter's times + this = wall-clock seconds (comparable across ranks)
        self._wall = time.time() - time.perf_counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing = False  # a write is under way on a worker thread
        self._again: str | None = None  # and another was asked for meanwhile (its reason)
        self._dumped_broken = False  # the broken group has been written since it broke
        if folder:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                self._loop = None
            _recorders.add(self)
            arm_signal()

    # --- on the runner's path ------------------------------------------------------------

    def record(self, key: OpKey, what: Entry, started: float, ended: float,
               strategy: str = "", error: BaseException | None = None) -> None:
        """Call ``key``, ``what`` (its collective, the strategy it was to run with or was
        asked for, its bytes, dtypes and shapes), ran from ``started`` to ``ended``
        (``time.perf_counter()``) with ``strategy`` ("": as ``what`` says), and failed
        with ``error`` (None: it did not). It takes the oldest call's place. A failure is
        written to the folder. (A call that did not fail is the runner's one append to
        :attr:`calls`, the same row.)"""
        if error is None:
            self.calls.append((key.number, what, started, ended, strategy))
            return
        if isinstance(error, CollectiveTimeout):
            waited = tuple(error.waiting_on)
        elif isinstance(error, PeerLost) and error.rank is not None:
            waited = (error.rank,)
        elif key.tag is None:
            waited = tuple(self._waited_for(key))
        else:  # a transfer: its one peer
            waited = (key.src if key.dst == self.rank else key.dst,)
        self.calls.append((key.number, what, started, ended, strategy, waited))
        if self.folder:
            self._dumped_broken = True
            self.dump(f"{what[0]} #{key.number} failed: {type(error).__name__}")

    def refused(self, error: BaseException) -> None:
        """A call was refused before it started (the group is broken: a peer's abort
        broke it between this rank's calls): written once."""
        if self.folder and not self._dumped_broken:
            self._dumped_broken = True
            self.dump(f"the group is broken: {type(error).__name__}")

    # --- reading -------------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """The record, the last ``size`` calls that ended and every call running, oldest
        (by start) first: ``seq`` (a collective's sequence number; a transfer's
        count on its channel), ``collective``, ``strategy`` (the one it ran with, "board"
        for the shared-memory board; while running, the one asked for), ``bytes`` (this
        rank's data), ``dtype``, ``shapes`` (a list of shape lists, one per array leaf, as
        the caller passed them; ``[]`` for none or none known yet), ``state``
        (``running``, ``done``, ``failed``), ``started`` and ``ended`` (wall-clock
        seconds, ``ended`` None while running) and
        ``waiting_for``: for a running call the ranks it still waits for, for a failed
        one those its error names; else ``[]``. Called on the group's loop."""
        wall = self._wall
        entries: list[tuple[float, int, dict[str, Any]]] = []
        for row in self.calls:
            seq, (collective, strategy, nbytes, dtype, shapes), started, ended, ran, *failed = row
            entries.append((started, seq, {
                "seq": seq, "collective": collective, "strategy": ran or strategy,
                "bytes": nbytes, "dtype": dtype, "shapes": [list(s) for s in shapes],
                "state": FAILED if failed else DONE,
                "started": started + wall, "ended": ended + wall,
                "waiting_for": list(failed[0]) if failed else []}))
        for key, what, started in self._running():
            if what is None:
                continue  # not described: not a call of the group's API
            collective, strategy, nbytes, dtype, shapes = what
            entries.append((started, key.number, {
                "seq": key.number, "collective": collective, "strategy": strategy,
                "bytes": nbytes, "dtype": dtype, "shapes": [list(s) for s in shapes],
                "state": RUNNING,
                "started": started + wall, "ended": None,
                "waiting_for": self._waiting(key)}))
        entries.sort(key=lambda e: e[:2])
        return [entry for _, _, entry in entries]

    # --- writing -------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return os.path.join(self.folder, f"rank-{self.rank}.json")

    def dump(self, reason: str) -> None:
        """Write the record to :attr:`path` (on a worker thread; the snapshot now). A dump
        asked for while one is being written follows it."""
        if not self.folder:
            return
        if self._writing:
            self._again = reason
            return
        document = {"format": FORMAT, "version": VERSION, "rank": self.rank,
                    "world_size": self.world_size, "group": self.group, "reason": reason,
                    "written": time.time(), "record": self.snapshot()}
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            write(self.path, document)
            return
        self._writing = True
        future = loop.run_in_executor(None, write, self.path, document)
        future.add_done_callback(self._written)

    def _written(self, future: asyncio.Future[None]) -> None:
        self._writing = False
        if not future.cancelled() and future.exception() is not None:
            log.warning("rank %d: could not write its flight record to %s: %s", self.rank,
                        self.path, future.exception())
        again, self._again = self._again, None
        if again is not None:
            self.dump(again)

    def on_signal(self) -> None:
        """SIGUSR1 came: dump on the group's loop (the record changes only there)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self.dump, "SIGUSR1")
        except RuntimeError:  # the loop closed meanwhile
            pass


def write(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` as JSON to ``path`` atomically (a temporary file beside it,
    renamed over it)."""
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(document, f, separators=(",", ":"))
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


class _Session(Protocol):
    flight: Recorder | None


class _Group(Protocol):
    @property
    def session(self) -> _Session: ...


def flight_record(group: _Group) -> list[dict[str, Any]]:
    """The flight record of ``group`` on this rank (``Group.flight_record()``): its last
    calls (``P2PCOLL_FLIGHT_RECORD``, 2,000), oldest first, as :meth:`Recorder.snapshot`
    describes them; ``[]`` when the record is off.

    Raises:
        GroupBroken: the group is closed.
    """
    recorder = group.session.flight
    return recorder.snapshot() if recorder is not None else []


# --- SIGUSR1 ---------------------------------------------------------------------------------

_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()  # those with a folder
_armed = False
_previous: Any = None


def arm_signal() -> bool:
    """Make SIGUSR1 dump every recorder that has a folder, once per process, if called
    from the main thread (a signal handler can be set only there; the blocking API and the
    torch backend call it from theirs). A handler set before is called after. Returns
    whether the handler is in place."""
    global _armed, _previous
    if _armed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous = signal.signal(signal.SIGUSR1, _on_sigusr1)
    _armed = True
    return True


def _on_sigusr1(signum: int, frame: FrameType | None) -> None:
    for recorder in list(_recorders):
        recorder.on_signal()
    previous = _previous
    if callable(previous):  # not SIG_DFL (which would end the process) or SIG_IGN
        previous(signum, frame)


__all__ = ["DONE", "FAILED", "FORMAT", "RUNNING", "VERSION", "Entry", "Recorder", "Row", "Shapes",
           "arm_signal", "describe", "flight_record", "write"]
