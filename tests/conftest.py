"""Fixtures shared by the test modules."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import zmq
import zmq.asyncio

import p2pcoll
from p2pcoll.testing import memory_groups

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


@asynccontextmanager
async def groups_of(n: int, **kwargs: Any) -> AsyncIterator[list[p2pcoll.Group]]:
    """``memory_groups(n, ...)``, closed at the end whatever happens."""
    groups = await memory_groups(n, **kwargs)
    try:
        yield groups
    finally:
        await asyncio.gather(*(g.close() for g in groups))
        assert all(g.state == "closed" for g in groups)


def finish(procs: Sequence[subprocess.Popen[str]], timeout: float = 60) -> list[tuple[int, str]]:
    """Wait for every process (at most ``timeout`` seconds each) and return (exit code,
    output) per process; whatever is still running then is killed, also on failure."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            stop(p)
    return out


def stop(p: subprocess.Popen[Any]) -> None:
    """Kill ``p`` if it still runs, reap it and close its pipes (left open, they surface
    as ResourceWarnings in whichever later test the garbage collector happens to run in)."""
    if p.poll() is None:
        p.kill()
    p.wait()
    for pipe in (p.stdin, p.stdout, p.stderr):
        if pipe is not None:
            pipe.close()
