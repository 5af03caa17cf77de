"""The rendezvous with 256 clients in one process (no mesh: the rendezvous alone).

Every client gets the same roster, its own rank and the endpoints of every other; a peer
that never comes is named by rank in every waiting peer's error; and the server's own
work stays linear (the roster is encoded once per group, its body shared by every reply;
each request costs O(1): counted below as the server's roster encodings and replies).
The join time is printed (``pytest -s``), not asserted.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

import p2pcoll
import p2pcoll.rendezvous.jobs as jobs_module
from p2pcoll.rendezvous import RendezvousServer
from p2pcoll.rendezvous.client import rendezvous
from p2pcoll.types import Membership

pytestmark = pytest.mark.slow

P = 256


def first(host: str, endpoints: list[str]) -> str:
    return endpoints[0]


async def client(url: str, rank: int | None, timeout: float = 60.0,
                 until: float | None = None) -> Membership:
    """A client of rank ``rank``; with ``until``, its join times out then (a moment shared
    by every client: one that timed out first leaves, and the errors of those that time
    out later would count it as missing)."""
    if until is not None:
        timeout = until - time.monotonic()
    return await rendezvous(
        url, endpoints=[f"tcp://127.0.0.1:{10000 + (rank if rank is not None else 0)}",
                        f"ipc:///tmp/p2pcoll-test-{id(object())}"],
        world_size=P, rank=rank, timeout=timeout, host_id=f"host-{(rank or 0) % 8}",
        choose=first)


def told_exactly(outcomes: list[object], says: str) -> int:
    """How many of the clients' errors say ``says``. Every outcome is a RendezvousError
    naming how many of P arrived and the first missing; the exact words are asked of most
    (not all): a client whose last status request goes out just before the shared moment
    may be answered after others' goodbyes for that moment were read (seen once in the
    slow tier: "1 of 256 peers arrived"), and its error then counts them missing."""
    for err in outcomes:
        assert isinstance(err, p2pcoll.RendezvousError), err
        assert f" of {P} peers arrived; missing ranks [" in str(err), err
    return sum(says in str(err) for err in outcomes)


async def test_two_hundred_fifty_six_clients_get_one_roster() -> None:
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    packed: list[int] = []  # sizes of the roster bodies the server encoded
    real_packb = msgpack.packb

    def counting_packb(obj: object, **kwargs: object) -> bytes:
        out = real_packb(obj, **kwargs)
        if isinstance(obj, dict) and "op" not in obj and "endpoints" in obj:  # a roster body
            packed.append(len(out))
        return out

    try:
        jobs_module.msgpack.packb = counting_packb  # type: ignore[assignment]
        started = time.monotonic()
        # Half ask for their rank (every odd one), the others take the free ranks.
        members = await asyncio.gather(*(client(url, r if r % 2 else None)
                                         for r in range(P)))
        print(f"\n{P} rendezvous clients in one process: roster in "
              f"{time.monotonic() - started:.2f} s")
    finally:
        jobs_module.msgpack.packb = real_packb  # type: ignore[assignment]
        await server.aclose()
    assert sorted(m.rank for m in members) == list(range(P))
    assert {m.world_size for m in members} == {P}
    assert len({(m.group_id, m.secret, m.endpoints, m.hosts) for m in members}) == 1
    roster = members[0]
    for r in range(1, P, 2):  # those that asked got the rank they asked for
        assert roster.endpoints[r] == f"tcp://127.0.0.1:{10000 + r}"
        assert roster.hosts[r] == f"host-{r % 8}"
    # The whole roster encoded once for the group, not once per member (O(p), not O(p^2)).
    assert len(packed) == 1, packed


async def test_a_missing_peer_among_two_hundred_fifty_six_is_named() -> None:
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    absent = 137
    until = time.monotonic() + 6.0
    try:
        outcomes = await asyncio.gather(*(client(url, r, until=until)
                                          for r in range(P) if r != absent),
                                        return_exceptions=True)
    finally:
        await server.aclose()
    assert len(outcomes) == P - 1
    exact = told_exactly(outcomes, f"{P - 1} of {P} peers arrived; missing ranks [{absent}]")
    assert exact >= 0.9 * len(outcomes), exact


@pytest.mark.parametrize("missing", [1, 40])
async def test_many_missing_ranks_are_counted_and_the_first_named(missing: int) -> None:
    """With many absent, the error lists the first ones and counts the rest (a status
    costs O(shown log p), whatever is missing)."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    absent = set(range(0, missing * 5, 5))
    until = time.monotonic() + 6.0
    try:
        outcomes = await asyncio.gather(*(client(url, r, until=until)
                                          for r in range(P) if r not in absent),
                                        return_exceptions=True)
    finally:
        await server.aclose()
    shown = sorted(absent)[:16]
    more = f" and {missing - 16} more" if missing > 16 else ""
    exact = told_exactly(outcomes, f"{P - missing} of {P} peers arrived; missing ranks "
                                   f"{shown}{more}")
    assert exact >= 0.9 * len(outcomes), exact
