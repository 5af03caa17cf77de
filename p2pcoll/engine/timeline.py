"""The timeline: every collective, and every send, receive and reduction inside it, as
Chrome trace events (open the file in https://ui.perfetto.dev or chrome://tracing).

With ``$P2PCOLL_TIMELINE=PATH`` (or ``join(timeline=PATH)``) each rank of each group writes
its own file beside ``PATH``: ``STEM-GROUP-rankR.json`` (``STEM`` is ``PATH`` without its
suffix, ``GROUP`` 8 hex digits of the group's id, :func:`group_tag`), so ranks never share a
file and a second group of the same process (a torch subgroup, the next elastic epoch) gets its own.
:func:`merge` joins the files of ``PATH`` into ``PATH`` itself; ``p2pcoll launch`` does it
when its ranks have exited, and ``p2pcoll timeline PATH`` does it by hand (after torchrun).

What a rank's file holds (Chrome's JSON array format; times in microseconds of the wall
clock, so the ranks of one host line up, and hosts as well as NTP keeps them):

- one complete event (``"ph": "X"``) per collective, named ``allreduce #12`` on the
  ``collectives`` track, with its strategy, bytes and segments; a failed one says its error;
- inside it, one per step of the strategy on the ``send``, ``recv`` and ``reduce`` tracks:
  a send lasts while the transport takes the message, a receive from the moment the rank
  waits for the piece until it has it (so a long one is time spent waiting for a peer), a
  reduction or copy while numpy folds the piece in;
- a flow arrow from each send to the receive it feeds (the same id on both ranks).

Events are written at the end of each collective (and every ``FLUSH_EVENTS`` within a long
one), so a rank that dies leaves a readable file with all but its last collective (the
closing bracket of the array format is optional). With no timeline nothing is
recorded: the executor checks one attribute per collective. With one, the executor runs
each collective over a :class:`Tracer`'s primitives (its instrumentation seam,
:class:`p2pcoll.engine.executor.Wire`), which record the steps around the real ones.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from ..errors import SettingsError
from ..strategy import Send
from ..transport.base import Piece, Tracker
from ..wire import Header
from .plan import Steps, send_groups

TRACKS = ("collectives", "send", "recv", "reduce")  # thread ids 0..3 of a rank's track
COLLECTIVE, SEND, RECV, REDUCE = range(len(TRACKS))  # what span() takes as its track
FLUSH_EVENTS = 256  # events kept in memory before they are written (if no collective ends)
_FLOW_MASK = (1 << 53) - 1  # flow ids stay exact in JavaScript's numbers

log = logging.getLogger("p2pcoll")


def rank_file(path: str | os.PathLike[str], group_id: str, rank: int) -> Path:
    """The file rank ``rank`` of group ``group_id`` writes for timeline ``path``."""
    p = Path(path)
    return p.with_name(f"{p.stem}-{group_tag(group_id)}-rank{rank}{p.suffix or '.json'}")


def group_tag(group_id: str) -> str:
    """Eight hex digits that tell the group's files and tracks apart (a checksum of its id:
    the same in every process, whatever characters the id has)."""
    return f"{zlib.crc32(group_id.encode()):08x}"


def flow_id(group_id: str, seq: object, seg: int, src: int, dst: int, count: int) -> int:
    """The id shared by a send's event on ``src`` and the matching receive's on ``dst``.

    Made of the message's identity, which both ranks know: the collective (or
    point-to-point transfer), the segment, the link and the message's number on it.
    """
    # Not hash(group_id): string hashes differ between processes.
    return hash((zlib.crc32(group_id.encode()), seq, seg, src, dst, count)) & _FLOW_MASK


class Timeline:
    """The trace of one rank of one group, written to :func:`rank_file` as it goes.

    Used by the executor (one per session); every method is cheap and never raises for a
    full disk after opening: a failed write stops the timeline and is logged once.
    """

    def __init__(self, path: str | os.PathLike[str], group_id: str, rank: int,
                 world_size: int) -> None:
        self.path = rank_file(path, group_id, rank)
        self.group_id = group_id
        self.rank = rank
        self._events: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        try:
            self._file = open(self.path, "w", encoding="utf-8")
        except OSError as exc:
            raise SettingsError(f"$P2PCOLL_TIMELINE: cannot write {str(self.path)!r}: {exc}",
                                name="P2PCOLL_TIMELINE", value=str(path),
                                allowed="a writable path") from exc
        self._first = True  # "[" goes with the first batch
        pid = os.getpid()
        self._pid = pid
        meta = {"group": group_id, "rank": rank, "world_size": world_size, "pid": pid,
                "host": os.uname().nodename}
        self._events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                             "args": {"name": f"rank {rank}", **meta}})
        self._events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                             "args": {"sort_index": rank}})
        for tid, track in enumerate(TRACKS):
            self._events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                 "args": {"name": track}})

    @staticmethod
    def now() -> float:
        """Microseconds of the wall clock (the time base every rank shares)."""
        return time.time_ns() / 1000.0

    def span(self, track: int, name: str, start: float, args: dict[str, Any] | None = None,
             *, starts: Sequence[int] = (), ends: Sequence[int] = ()) -> None:
        """A complete event on ``track`` (an index of :data:`TRACKS`) from ``start`` to now,
        starting the flow arrows ``starts`` (sends) and ending ``ends`` (receives)."""
        end = self.now()
        event: dict[str, Any] = {"ph": "X", "name": name, "pid": self._pid, "tid": track,
                                 "ts": start, "dur": end - start}
        if args:
            event["args"] = args
        events = self._events
        events.append(event)
        for ident in starts:
            events.append({"ph": "s", "name": "message", "cat": "message", "id": ident,
                           "pid": self._pid, "tid": track, "ts": start})
        for ident in ends:  # "bp": "e" binds the arrow's head to the receive around it
            events.append({"ph": "f", "bp": "e", "name": "message", "cat": "message",
                           "id": ident, "pid": self._pid, "tid": track, "ts": end})
        if track == COLLECTIVE or len(events) >= FLUSH_EVENTS:
            self.flush()  # at the end of each collective: a rank killed loses only its last

    def flush(self) -> None:
        """Write what is recorded so far."""
        if self._file is None or not self._events:
            self._events.clear()
            return
        parts = []
        for event in self._events:
            parts.append(("[\n" if self._first else ",\n") +
                         json.dumps(event, separators=(",", ":")))
            self._first = False
        self._events.clear()
        try:
            self._file.write("".join(parts))
            self._file.flush()
        except OSError as exc:
            log.warning(
                "timeline %s: write failed, no more events are recorded: %s", self.path, exc)
            self._stop()

    def close(self) -> None:
        """Write the rest and the closing bracket; later events are ignored."""
        if self._file is None:
            return
        self.flush()
        if self._file is not None:
            try:
                self._file.write("[\n]\n" if self._first else "\n]\n")
            except OSError:
                pass
            self._stop()

    def _stop(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


class Primitives(Protocol):
    """What a :class:`Tracer` wraps (the executor's :class:`~p2pcoll.engine.executor.Wire`)."""

    @property
    def send_many(self) -> Callable[..., Awaitable[Tracker | None]]: ...
    @property
    def get(self) -> Callable[[Any], Awaitable[tuple[Header, list[Piece]]]]: ...
    @property
    def combine(self) -> Callable[..., None]: ...


class Tracer:
    """The primitives of one collective with each send, receive and fold recorded.

    Built from the collective's plan (``steps``), which tells which step and chunk each
    message of a link is (the n-th message to a peer within a segment is the same in every
    segment); the messages' headers and keys say the rest, flow ids included.
    """

    def __init__(self, timeline: Timeline, inner: Primitives, steps: Steps, rank: int) -> None:
        self.timeline, self.inner, self.rank = timeline, inner, rank
        self._sent: dict[tuple[int, int], tuple[int, object]] = {}  # (to, n) -> step, chunk
        self._received: dict[tuple[int, int], tuple[int, object]] = {}  # (from, n) -> same
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        for i, (ops, groups) in enumerate(zip(steps, send_groups(steps), strict=True)):
            for chunk, group in groups:
                for _, to in group:
                    self._sent[(to, sent.get(to, 0))] = (i, chunk)
                    sent[to] = sent.get(to, 0) + 1
            for op in ops:
                if not isinstance(op, Send):
                    n = received.get(op.frm, 0)
                    self._received[(op.frm, n)] = (i, op.chunk)
                    received[op.frm] = n + 1

    async def send_many(self, dsts: Sequence[int], headers: Sequence[Header],
                        pieces: Sequence[np.ndarray] = (), *, copy: bool = False
                        ) -> Tracker | None:
        timeline = self.timeline
        started = timeline.now()
        tracker = await self.inner.send_many(dsts, headers, pieces, copy=copy)
        first = headers[0]
        step, chunk = self._sent.get((dsts[0], first.step), (-1, None))
        flow_seq = (first.seq, -1 if first.tag is None else first.tag)
        flows = [flow_id(timeline.group_id, flow_seq, first.seg, self.rank, to, h.step)
                 for to, h in zip(dsts, headers, strict=True)]
        timeline.span(SEND, "send", started, {
            "to": list(dsts), "chunk": chunk_name(chunk), "step": step, "segment": first.seg,
            "bytes": sum(p.nbytes for p in pieces)}, starts=flows)
        return tracker

    async def get(self, key: Any) -> tuple[Header, list[Piece]]:
        timeline = self.timeline
        started = timeline.now()
        header, pieces = await self.inner.get(key)
        op, seg, frm, n = key  # op: the OpKey of a collective or a transfer
        flow_seq = (op.number, -1 if op.tag is None else op.tag)
        flow = flow_id(timeline.group_id, flow_seq, seg, frm, self.rank, n)
        timeline.span(RECV, "recv", started, self._where(frm, n, seg, header), ends=(flow,))
        return header, pieces

    def combine(self, header: Header, targets: Sequence[np.ndarray], pieces: Sequence[Piece],
                ufunc: Callable[..., Any] | None) -> None:
        started = self.timeline.now()
        self.inner.combine(header, targets, pieces, ufunc)
        self.timeline.span(REDUCE, "copy" if ufunc is None else "reduce", started,
                           self._where(header.src, header.step, header.seg, header))

    def _where(self, frm: int, n: int, seg: int, header: Header) -> dict[str, Any]:
        step, chunk = self._received.get((frm, n), (-1, None))
        return {"from": frm, "chunk": chunk_name(chunk), "step": step, "segment": seg,
                "bytes": sum(header.nbytes)}


def chunk_name(chunk: object) -> int | str:
    """A chunk as the timeline shows it: its index, ``a..b`` for a range, ``i,j,k`` for a
    tuple, ``all``."""
    if isinstance(chunk, int):
        return chunk
    if isinstance(chunk, range):
        return f"{chunk.start}..{chunk.stop - 1}"
    if isinstance(chunk, tuple):
        return ",".join(map(str, chunk))
    return "all"


# --- merging ------------------------------------------------------------------------------

def rank_files(path: str | os.PathLike[str]) -> list[Path]:
    """The rank files written for timeline ``path`` (every group, every rank)."""
    p = Path(path)
    pattern = re.compile(re.escape(p.stem) + r"-[0-9a-f]{8}-rank\d+" +
                         re.escape(p.suffix or ".json") + "$")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        return []
    return sorted(f for f in folder.iterdir() if pattern.fullmatch(f.name))


def read_events(file: Path) -> list[dict[str, Any]]:
    """The events of one rank file, also when its rank died before closing it.

    Raises:
        ValueError: the file is not a timeline (naming it).
    """
    text = file.read_text(encoding="utf-8").rstrip()
    if not text:  # its rank died before the first collective ended
        return []
    text = text.removesuffix(",")
    if not text.endswith("]"):
        text += "\n]"
    try:
        events = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{file} is not a p2pcoll timeline: {exc}") from None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{file} is not a p2pcoll timeline: not a list of events")
    return events


def merge(path: str | os.PathLike[str], files: Sequence[Path] | None = None, *,
          remove: bool = True) -> int:
    """Join the rank files of timeline ``path`` (or ``files``) into ``path``: one track per
    rank of each group (ranks of one group together, groups in the order they started),
    as ``{"traceEvents": [...]}``. Returns the number of files merged (0: nothing written).

    Each rank's events keep their times; tracks are renumbered, so the ranks of one host
    (or several groups of one process) stay apart. ``remove`` deletes the rank files once
    the merged file is written.

    Raises:
        ValueError: a rank file is not a timeline.
        OSError: ``path`` cannot be written.
    """
    files = list(rank_files(path) if files is None else files)
    if not files:
        return 0
    traces = []
    for file in files:
        events = read_events(file)
        info: dict[str, Any] = next((e.get("args", {}) for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"), {})
        start = min((e["ts"] for e in events if "ts" in e), default=0.0)
        traces.append((str(info.get("group", "")), int(info.get("rank", 0)), start, events))
    first_seen: dict[str, float] = {}
    for group, _, start, _ in traces:
        first_seen[group] = min(first_seen.get(group, start), start)
    traces.sort(key=lambda t: (first_seen[t[0]], t[0], t[1]))
    several = len(first_seen) > 1
    merged: list[dict[str, Any]] = []
    for track, (group, rank, _, events) in enumerate(traces, start=1):
        for event in events:
            event = dict(event, pid=track)
            if event.get("ph") == "M" and event.get("name") == "process_name":
                label = f"rank {rank}" + (f" (group {group_tag(group)})" if several else "")
                event["args"] = dict(event.get("args", {}), name=label)
            elif event.get("ph") == "M" and event.get("name") == "process_sort_index":
                event["args"] = {"sort_index": track}
            merged.append(event)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in merged))
        f.write("\n]}\n")
    os.replace(tmp, out)
    if remove:
        for file in files:
            if file != out:
                file.unlink(missing_ok=True)
    return len(files)


def events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The events of a merged timeline or of one rank file (for scripts and tests)."""
    p = Path(path)
    text = p.read_text(encoding="utf-8").lstrip()
    if text.startswith("{"):
        yield from json.loads(text)["traceEvents"]
    else:
        yield from read_events(p)


__all__ = ["COLLECTIVE", "RECV", "REDUCE", "SEND", "TRACKS", "Timeline", "Tracer", "chunk_name",
           "events", "group_tag", "merge", "rank_file", "rank_files"]
