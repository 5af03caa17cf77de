"""``p2pcoll flight DIR``: why a job is stuck or failed, from the ranks' flight records.

Each rank of a group run with ``P2PCOLL_FLIGHT_DIR=DIR`` writes ``DIR/rank-R.json`` when a
call fails and on SIGUSR1 (:mod:`p2pcoll.session.flight`). :func:`load` reads them (JSON
only, each at most :data:`MAX_FILE_BYTES`; a file that is truncated, too large or not a
flight record is reported and left out); :func:`analyse`, a pure function of what was
read, finds:

- the first collective (by sequence number) where the ranks differ: in the collective,
  its bytes, its dtypes or its shapes (two ranks' (4, 8) and (8, 4) move the same bytes;
  an all-to-all's sizes are each rank's own, so there only the dtypes count), or because
  some rank had not started it;
- whom the ranks wait for: what each rank's running calls, and its first failed one,
  still wait for (or its error named), and the ranks those waits lead to (named, and
  waiting for nobody themselves: a ring's rank waits for its neighbour, which may wait
  further up);
- the ranks whose file is missing (a rank frozen, killed, or never told).

Point-to-point transfers are numbered per channel, not per group: they are not compared,
but what they wait for counts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .session.blame import ranks_text
from .session.flight import FAILED, FORMAT, RUNNING

MAX_FILE_BYTES = 256 << 20  # a record of a million calls is ~200 MB
FILE_NAME = re.compile(r"rank-(\d+)\.json")
# The keys of an entry and their types.
KEYS: dict[str, type | tuple[type, ...]] = {
    "seq": int, "collective": str, "strategy": str, "bytes": int, "dtype": str, "state": str,
    "started": (int, float), "ended": (int, float, type(None)), "waiting_for": list}
# Collectives whose bytes and shapes are each rank's own (an all-to-all's parts have the
# lengths its rank sends: alltoallv): ranks agree on their dtypes, not their sizes.
SIZES_DIFFER = frozenset({"alltoall"})
SHAPES_SHOWN = 4  # a call's shapes shown in the report (a pytree may have thousands)
TRANSFERS = ("send", "recv")


@dataclass(frozen=True)
class RankFile:
    """One rank's file, read and checked."""

    rank: int
    world_size: int
    group: str
    reason: str
    record: list[dict[str, Any]]


@dataclass
class Loaded:
    """What :func:`load` found: the files read, by rank, and the ones it could not use, by
    file name, with why."""

    files: dict[int, RankFile] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)


@dataclass
class Analysis:
    """What :func:`analyse` found (see the module docstring).

    Attributes:
        group: the group the files are of.
        world_size: its size.
        ranks: the ranks whose records were analysed.
        missing: ranks of the group with no usable file.
        first_difference: the sequence number of the first collective the ranks differ
            in, or None.
        at_difference: what each rank did there, by rank (``"allreduce 4096 bytes float32
            (failed)"``, ``"not started (its last: #4)"``).
        waits: by waiting rank, what it waits for (``[(what, [ranks])]``).
        waited_for: the ranks the waits lead to: those named that wait for nobody
            (else, in a circle of waits, those named most).
        bad: files left out and why (from :class:`Loaded`).
        foreign: ranks whose file is of another group.
    """

    group: str
    world_size: int
    ranks: list[int]
    missing: list[int]
    first_difference: int | None = None
    at_difference: dict[int, str] = field(default_factory=dict)
    waits: dict[int, list[tuple[str, list[int]]]] = field(default_factory=dict)
    waited_for: list[int] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)


# --- reading ----------------------------------------------------------------------------------


def load(folder: str) -> Loaded:
    """Read every ``rank-R.json`` in ``folder``.

    Raises:
        OSError: ``folder`` cannot be listed.
    """
    loaded = Loaded()
    for name in sorted(os.listdir(folder)):
        m = FILE_NAME.fullmatch(name)
        if m is None:
            continue
        try:
            loaded.files[int(m.group(1))] = read(os.path.join(folder, name), int(m.group(1)))
        except ValueError as exc:
            loaded.bad[name] = str(exc)
    return loaded


def read(path: str, rank: int) -> RankFile:
    """The flight record in ``path``, which should be rank ``rank``'s.

    Raises:
        ValueError: saying why it cannot be used: unreadable, too large, not JSON
            (truncated), or not a flight record of rank ``rank``.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"unreadable: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB: not read")
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"truncated or not JSON ({exc})") from None
    return parse(document, rank)


def parse(document: object, rank: int) -> RankFile:
    """Check a decoded file (see :func:`read`)."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"foreign: not a p2pcoll flight record (no \"format\": \"{FORMAT}\")")
    fields = {"rank": int, "world_size": int, "group": str, "record": list}
    for key, kind in fields.items():
        if not isinstance(document.get(key), kind) or isinstance(document.get(key), bool):
            raise ValueError(f"foreign: its {key!r} is missing or not a {kind.__name__}")
    if document["rank"] != rank:
        raise ValueError(f"foreign: it is rank {document['rank']}'s record, not rank {rank}'s")
    if not 0 <= rank < document["world_size"]:
        raise ValueError(f"foreign: rank {rank} is not in a group of {document['world_size']}")
    record = document["record"]
    for i, entry in enumerate(record):
        if not isinstance(entry, dict) or any(
                not isinstance(entry.get(k, ...), t) for k, t in KEYS.items()) or (
                "shapes" in entry and not _shape_lists(entry["shapes"])):
            raise ValueError(f"foreign: entry {i} of its record is not a flight record entry")
    return RankFile(rank, document["world_size"], document["group"],
                    str(document.get("reason", "")), record)


def _shape_lists(value: object) -> bool:
    """Whether ``value`` is what an entry's optional ``shapes`` is: a list of lists of
    non-negative ints (files written before it was recorded have none)."""
    return isinstance(value, list) and all(
        isinstance(s, list) and all(type(n) is int and n >= 0 for n in s) for s in value)


# --- analysing ----------------------------------------------------------------------------


def analyse(loaded: Loaded) -> Analysis | None:
    """What the records say (see the module docstring); None when there is none."""
    bad = dict(loaded.bad)
    if not loaded.files:
        return None
    # The group most files are of; the others' files are foreign to it.
    groups: dict[str, int] = {}
    for f in loaded.files.values():
        groups[f.group] = groups.get(f.group, 0) + 1
    group = max(groups, key=lambda g: (groups[g], g))
    files = {}
    for rank, f in sorted(loaded.files.items()):
        if f.group == group:
            files[rank] = f
        else:
            bad[f"rank-{rank}.json"] = f"foreign: of group {f.group!r}, not {group!r}"
    world = max(f.world_size for f in files.values())
    result = Analysis(group, world, sorted(files),
                      [r for r in range(world) if r not in files], bad=bad)
    _first_difference(result, {r: _collectives(f.record) for r, f in files.items()})
    _waits(result, {r: f.record for r, f in files.items()})
    return result


def _collectives(record: Sequence[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    return {e["seq"]: e for e in record if e["collective"] not in TRANSFERS}


def shapes(entry: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The entry's shapes as a comparable value; None when its file does not say (written
    before shapes were recorded: it compares equal to any)."""
    given = entry.get("shapes")
    if given is None:
        return None
    return tuple(tuple(s) for s in given)


def describe(entry: Mapping[str, Any]) -> str:
    """``allreduce 4096 bytes float32 shapes [4, 8] (failed)``; ``broadcast (failed)`` for
    no data (a barrier) or none known (a receiver that had not learned its layout). At most
    :data:`SHAPES_SHOWN` shapes are listed, then how many leaves there are."""
    data = f" {entry['bytes']} bytes {entry['dtype']}" if entry["dtype"] else ""
    given = entry.get("shapes") or []
    if entry["dtype"] and given:
        listed = " ".join(str(s) for s in given[:SHAPES_SHOWN])
        more = f" ... ({len(given)} leaves)" if len(given) > SHAPES_SHOWN else ""
        data += f" shape{'s' if len(given) > 1 else ''} {listed}{more}"
    return f"{entry['collective']}{data} ({entry['state']})"


def _first_difference(result: Analysis, by_rank: Mapping[int, Mapping[int, Mapping[str, Any]]]
                      ) -> None:
    """The first sequence number, within what every record still holds, where the ranks'
    collectives differ or some rank has not started it."""
    kept = [seqs for seqs in by_rank.values() if seqs]
    if not kept:
        return
    first = max(min(seqs) for seqs in kept)  # older calls have left some rank's ring
    for seq in sorted({s for seqs in kept for s in seqs if s >= first}):
        seen = {r: seqs.get(seq) for r, seqs in by_rank.items()}
        kinds = {(e["collective"], *_agreed(e)) for e in seen.values() if e}
        known = {shapes(e) for e in seen.values() if e
                 if e["collective"] not in SIZES_DIFFER} - {None}
        if len(kinds) > 1 or len(known) > 1 or None in seen.values():
            result.first_difference = seq
            for r, e in sorted(seen.items()):
                if e is not None:
                    result.at_difference[r] = describe(e)
                else:
                    before = [s for s in by_rank[r] if s < seq]
                    result.at_difference[r] = "not started" + (
                        f" (its last: #{max(before)})" if before else "")
            return


def _agreed(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """What every rank's entry of one call must share beside the collective: bytes and
    dtypes, or only dtypes where the sizes are each rank's own (:data:`SIZES_DIFFER`)."""
    if entry["collective"] in SIZES_DIFFER:
        return (entry["dtype"],)
    return (entry["bytes"], entry["dtype"])


def _waits(result: Analysis, records: Mapping[int, Sequence[Mapping[str, Any]]]) -> None:
    """Whom each rank waits for: its running calls and its first failed one."""
    named: dict[int, int] = {}
    for rank, record in sorted(records.items()):
        waits = []
        failed = next((e for e in record if e["state"] == FAILED), None)
        for e in record:
            if (e["state"] == RUNNING or e is failed) and e["waiting_for"]:
                on = sorted({r for r in e["waiting_for"] if isinstance(r, int) and r != rank})
                if on:
                    waits.append((f"{e['collective']} #{e['seq']} ({e['state']})", on))
        if waits:
            result.waits[rank] = waits
            for r in {r for _, on in waits for r in on}:
                named[r] = named.get(r, 0) + 1
    if not named:
        return
    # The ends of the chains: named ranks that wait for nobody themselves (a ring's rank
    # waits for its neighbour, which waits further up); in a circle, those named most.
    ends = [r for r in sorted(named) if r not in result.waits]
    most = max(named.values())
    result.waited_for = ends or [r for r in sorted(named) if named[r] == most]


def report(folder: str, analysis: Analysis) -> str:
    """The text ``p2pcoll flight`` prints."""
    a = analysis
    lines = [f"{folder}: the flight records of {len(a.ranks)} of {a.world_size} ranks "
             f"(group {a.group})"]
    if a.first_difference is None:
        lines.append("the ranks agree on every collective their records hold")
    else:
        lines.append(f"first difference: collective #{a.first_difference}")
        lines.extend(f"  rank {r}: {what}" for r, what in sorted(a.at_difference.items()))
    if a.waits:
        lines.append("waiting:")
        for rank, waits in sorted(a.waits.items()):
            for what, on in waits:
                lines.append(f"  rank {rank} in {what} waits for {ranks_text(on)}")
        lines.append(f"everyone waits for {ranks_text(a.waited_for)}")
    else:
        lines.append("nobody waits")
    if a.missing:
        lines.append(f"missing: {ranks_text(a.missing)} (no usable rank-R.json)")
    for name, why in sorted(a.bad.items()):
        lines.append(f"left out: {name}: {why}")
    return "\n".join(lines) + "\n"


__all__ = ["MAX_FILE_BYTES", "Analysis", "Loaded", "RankFile", "analyse", "describe", "load",
           "parse", "read", "report", "shapes"]
