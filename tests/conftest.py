"""Fixtures shared by the test modules."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import pytest
import zmq
import zmq.asyncio

import p2pcoll

# The link identity (and source rank) of the rogue sender: no member of a test group uses it.
ROGUE_RANK = 5

Inject = Callable[[p2pcoll.Group, Sequence[Sequence[bytes]]], Awaitable[int]]


@pytest.fixture
def inject() -> Inject:
    """``await inject(g, messages)``: send raw multipart messages to ``g`` from a socket that is
    no member's link (identity ``b"5"``), give ``g`` half a second to read them, and return
    how many messages ``g`` has dropped since it joined."""

    async def send(g: p2pcoll.Group, messages: Sequence[Sequence[bytes]]) -> int:
        bad = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        bad.setsockopt(zmq.IDENTITY, b"%d" % ROGUE_RANK)
        bad.connect(g.endpoint)
        try:
            for frames in messages:
                await bad.send_multipart(frames)
            await asyncio.sleep(0.5)
        finally:
            bad.close(linger=0)
        return g.stats()["messages_dropped"]

    return send
