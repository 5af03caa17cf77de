"""One peer process of tests/test_link_budget.py: a peer under a link budget.

    P2PCOLL_RENDEZVOUS=... WORLD_SIZE=N RANK=r P2PCOLL_MAX_LINKS=4 \
        python tests/link_budget_worker.py DIR MODE [ARGS...]

Every mode joins, does its part, prints JSON report lines (``{"ready": {...}}``,
``{"after": {...}}``, read by tests/peer_processes.py) and leaves once DIR/done appears
(so that no peer's departure is mixed into another's test). What a peer reports of its
links: ``open`` (``links_opened - links_closed`` from ``group.stats()``), ``links`` (the
peers its mesh holds a data link to now), ``pinned`` (of all peers, those the budget may not
close a link to: the two it watches on the overlay and those it has a shared-memory lane
to).

Modes:

- ``collectives``: from every root in turn a flat root broadcast (small, and once large
  enough to go zero-copy), a gather and a scatter; then a ring allreduce. After each call
  the peer notes its links; ``ready`` says which results were wrong and every note.
- ``p2p ROUNDS``: rank 0 sends to ranks 1..N-1 in a pattern where nearly every send under
  a budget of 4 closes one link and reopens another (see :func:`p2p_turns`; to each rank a
  large message, then a small one), ROUNDS times; the others receive every message and check
  it. Rank 0 reports the order in which it queued its messages to each rank, each receiver
  the order in which its transport handed them on.
- ``fail VICTIM``: rank 0 sends one message to every other rank (opening and closing links);
  ``ready`` once all have it. After DIR/go (the test has killed or frozen VICTIM) rank 0
  sends to VICTIM, then every survivor runs a ring allreduce; ``after``: what each raised
  and the seconds from DIR/go.
- ``leave NBYTES``: rank 0 broadcasts NBYTES (flat root broadcast) and leaves at once;
  the others report whether what they received is right.
- ``slow COUNT SECONDS``: a link closed for the budget while its receiver does not read
  (see :func:`slow`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np

import p2pcoll
from p2pcoll.departures import overlay


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def wait_for_file(path: str, limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def links(g: p2pcoll.Group) -> dict[str, Any]:
    """This peer's links now: counted, held, pinned (see the module docstring)."""
    stats = g.stats()
    mesh: Any = g.session.transport  # a ZmqMesh: its routes are what the test is about
    routes = mesh.routes.routes  # peer -> Route (.link, .generation, .lane)
    laned = {peer for peer, route in routes.items() if route.lane is not None}
    pinned = set(overlay.watched(g.rank, g.world_size)) | laned
    return {"open": stats["links_opened"] - stats["links_closed"],
            "opened": stats["links_opened"], "closed": stats["links_closed"],
            "links": sorted(routes), "pinned": sorted(pinned),
            # closed links whose end the peer has not answered yet (their sockets are open)
            "draining": len(mesh.routes.draining),
            "refused": stats["links_refused"], "dropped": stats["messages_dropped"],
            "dropped_by": stats["messages_dropped_by_reason"]}


async def collectives(g: p2pcoll.Group, where: str) -> None:
    r, p = g.rank, g.world_size
    wrong: list[str] = []
    notes: list[dict[str, Any]] = []

    def note(call: str) -> None:
        notes.append({"call": call, "fds": len(os.listdir("/proc/self/fd")), **links(g)})

    large = np.arange(100_000, dtype=np.float64)  # 800 KB: sent zero-copy
    for root in range(p):
        got = await g.broadcast(np.arange(5.0) + root if r == root else None, root=root,
                                strategy="root")
        if not np.array_equal(got, np.arange(5.0) + root):
            wrong.append(f"broadcast from {root}")
        note(f"broadcast {root}")
        got = await g.broadcast(large + root if r == root else None, root=root,
                                strategy="root")
        if not np.array_equal(got, large + root):
            wrong.append(f"large broadcast from {root}")
        note(f"large broadcast {root}")
        gathered = await g.gather(np.array([r, root], np.int64), root=root, strategy="root")
        if r == root:
            if gathered is None or not np.array_equal(np.stack(gathered),
                                                      [[q, root] for q in range(p)]):
                wrong.append(f"gather to {root}")
        elif gathered is not None:
            wrong.append(f"gather to {root}: not None on rank {r}")
        note(f"gather {root}")
        parts = [np.array([q * 100 + root], np.int64) for q in range(p)]
        piece = await g.scatter(parts if r == root else None, root=root, strategy="root")
        if not np.array_equal(piece, [r * 100 + root]):
            wrong.append(f"scatter from {root}")
        note(f"scatter {root}")
    total = await g.allreduce(np.arange(1000, dtype=np.float64) + r, strategy="ring")
    if not np.array_equal(total, np.arange(1000, dtype=np.float64) * p + p * (p - 1) / 2):
        wrong.append("ring allreduce")
    note("ring allreduce")
    final = links(g)
    await asyncio.sleep(1.0)  # the peers answer the ends of the links closed last
    say(ready={"rank": r, "wrong": wrong, "notes": notes, "final": final,
               "settled": {"fds": len(os.listdir("/proc/self/fd")), **links(g)}})
    await wait_for_file(os.path.join(where, "done"))


def p2p_turns(p: int) -> list[int]:
    """The destinations of one round: the two ranks rank 0 watches (its links to them are
    pinned), then the others in threes, each three twice in a row (1 2 3 4 5 3 4 5 6 7 8 6 7
    8 ...): with two unpinned links under a budget of 4, every send to one of the others
    but the first two closes one link and reopens another."""
    watched = overlay.watched(0, p)
    others = [q for q in range(1, p) if q not in watched]
    turns = list(watched)
    for i in range(0, len(others), 3):
        three = others[i:i + 3]
        turns += three + three
    return turns


def message(round_: int, turn: int, dst: int, large: bool) -> np.ndarray:
    """What rank 0 sends to ``dst`` at its ``turn`` of ``round_``: 2 MiB (two segments,
    zero-copy, likely still in flight when its link is closed) or 16 elements, marked with
    what identifies it."""
    out = np.arange((1 << 18) if large else 16, dtype=np.float64)
    out[:3] = (round_, turn, dst)
    return out


async def p2p(g: p2pcoll.Group, where: str, rounds: int) -> None:
    """Every message on tag 0, so one channel. The transport's order is what the test
    checks: rank 0's ``sent`` hook notes each data message (transfer count, segment) in the
    order it was queued on a link or lane, each receiver's ``delivered`` hook in the order it
    was handed on (the matcher would put reordered messages right by their keys, and the
    segments of one message may be queued out of their order: they run concurrently)."""
    r, p = g.rank, g.world_size
    turns = p2p_turns(p)
    mesh: Any = g.session.transport
    if r == 0:
        sent: dict[int, list[tuple[int, int]]] = {q: [] for q in range(1, p)}

        def queued(dst: int, header: Any, nbytes: int) -> None:
            if header.tag is not None:
                sent[dst].append((header.seq, header.seg))

        mesh.sent = queued
        await g.barrier()  # every receiver's hook is in place
        most = 0
        for round_ in range(rounds):
            for turn, dst in enumerate(turns):
                large = turns.index(dst) == turn  # the first of the two in a round
                await g.send(message(round_, turn, dst, large), dst)
                most = max(most, links(g)["open"])
        say(ready={"rank": r, "wrong": [], "most": most, "sent": sent, "final": links(g)})
    else:
        arrived: list[tuple[int, int]] = []  # (transfer count, segment) as delivered

        def delivered(src: int, header: Any, nbytes: int) -> None:
            if src == 0 and header.tag is not None:
                arrived.append((header.seq, header.seg))

        mesh.delivered = delivered
        await g.barrier()
        wrong = []
        mine = [turn for turn, dst in enumerate(turns) if dst == r]
        for round_ in range(rounds):
            for turn in mine:
                got = await g.recv(0, timeout=120)
                want = message(round_, turn, r, large=turn == mine[0])
                if not np.array_equal(got, want):
                    wrong.append(f"round {round_} turn {turn}: got {got[:3].tolist()} "
                                 f"({got.size} elements)")
        say(ready={"rank": r, "wrong": wrong[:10], "arrived": arrived, "final": links(g)})
    await wait_for_file(os.path.join(where, "done"))


async def fail(g: p2pcoll.Group, where: str, victim: int) -> None:
    r, p = g.rank, g.world_size
    if r == 0:
        for dst in range(1, p):
            await g.send(np.array([dst], np.int64), dst)
        # wait until each has it, so that the victim is alive and linked before the test
        for src in range(1, p):
            await g.recv(src)
    else:
        got = await g.recv(0)
        await g.send(got, 0)
    say(ready={"rank": r, "final": links(g)})
    go = os.path.join(where, "go")
    await wait_for_file(go)
    start = os.stat(go).st_mtime
    sent = ""
    if r == 0:
        try:
            await g.send(np.arange(3.0), victim, timeout=120)
        except p2pcoll.P2PCollError as exc:
            sent = f"{type(exc).__name__}: {exc}"
    error = ""
    try:
        await g.allreduce(np.ones(4), strategy="ring", timeout=120)
    except p2pcoll.P2PCollError as exc:
        error = f"{type(exc).__name__}: {exc}"
    say(after={"rank": r, "sent": sent, "error": error, "seconds": time.time() - start,
               "final": links(g)})
    await wait_for_file(os.path.join(where, "done"))


async def leave(g: p2pcoll.Group, where: str, nbytes: int) -> None:
    r = g.rank
    data = np.arange(nbytes // 8, dtype=np.float64)
    error, right = "", False
    try:
        got = await g.broadcast(data if r == 0 else None, root=0, strategy="root",
                                timeout=120)
        right = bool(np.array_equal(got, data))
    except p2pcoll.P2PCollError as exc:
        error = f"{type(exc).__name__}: {exc}"
    say(after={"rank": r, "right": right, "error": error, "final": links(g)})
    if r != 0:  # rank 0 leaves at once (its goodbye follows the broadcast)
        await wait_for_file(os.path.join(where, "done"))


async def slow(g: p2pcoll.Group, where: str, count: int, sleep: float) -> None:
    """Rank 0 sends ``count`` messages of 32 KiB to rank 3 while rank 3's event loop is
    blocked for ``sleep`` seconds (a long computation), then one message each to ranks 4
    and 5 (under a budget of 4 that closes the link to rank 3 with messages still queued on
    it), then one more to rank 3 (on a new link). Ranks 3, 4, 5 report what they received."""
    r = g.rank
    await g.barrier()
    start = time.monotonic()
    error, right, got_count, closed_at = "", True, 0, 0.0
    if r == 0:
        await asyncio.sleep(0.5)  # rank 3 is asleep by now
        for i in range(count):
            await g.send(np.full(4096, float(i)), 3)
        await g.send(np.array([4.0]), 4)
        await g.send(np.array([5.0]), 5)
        closed_at = time.monotonic() - start  # the link to rank 3 closed by now
        await g.send(np.full(4096, float(count)), 3)
    elif r == 3:
        time.sleep(sleep)  # blocks the event loop: nothing is read meanwhile
        try:
            for i in range(count + 1):
                got = await g.recv(0, timeout=30)
                right = right and bool(np.array_equal(got, np.full(4096, float(i))))
                got_count += 1
        except p2pcoll.P2PCollError as exc:
            error = f"{type(exc).__name__}: {exc}"
    elif r in (4, 5):
        got = await g.recv(0, timeout=60)
        right = bool(np.array_equal(got, [float(r)]))
    say(after={"rank": r, "right": right, "received": got_count, "error": error,
               "closed_at": closed_at, "final": links(g)})
    await wait_for_file(os.path.join(where, "done"))


async def main() -> None:
    where, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    async with p2pcoll.join(timeout=300) as g:
        if mode == "collectives":
            await collectives(g, where)
        elif mode == "p2p":
            await p2p(g, where, int(args[0]))
        elif mode == "fail":
            await fail(g, where, int(args[0]))
        elif mode == "leave":
            await leave(g, where, int(args[0]))
        elif mode == "slow":
            await slow(g, where, int(args[0]), float(args[1]))
        else:
            raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    asyncio.run(main())
