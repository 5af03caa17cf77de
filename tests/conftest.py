"""Fixtures shared by the test modules."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

import p2pcoll
from p2pcoll.testing import memory_groups

# --- the test tiers ---------------------------------------------------------------------------
# `python -m pytest` runs the fast tier: pure logic, the memory transport, one real-socket pass
# per transport, hostile input and security (pyproject's addopts: -m "not processes and not
# slow"). A test that starts peer processes is marked `processes`; torch's suite and hooks,
# Ray, network namespaces, scale and the container are `slow`. Each test is in one tier.
SLOW_KINDS = ("scale", "container")  # markers of their own, and slow as well


@pytest.hookimpl(tryfirst=True)  # before -m selects: the markers added here count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") and item.get_closest_marker("processes"):
            raise pytest.UsageError(f"{item.nodeid} is marked both slow and processes: "
                                    "each test belongs to one tier (slow, when both fit)")


# --- a stuck run ends, with every thread's stack ----------------------------------------------
# pytest-timeout fails a test that overruns by raising in the main thread, which cannot happen
# while that thread is blocked in C holding the interpreter lock, or is stuck between two tests.
# faulthandler's watchdog is a C thread that needs neither: re-armed for each test at its
# timeout plus a margin, it writes every thread's stack to the real stderr and ends the run, so
# CI fails in minutes with the place of the hang instead of hanging until it is killed.
HANG_MARGIN_S = 120
_stderr_copy: Any = None


def pytest_configure(config: pytest.Config) -> None:
    global _stderr_copy
    # fd 2 is the terminal here; during a test, output capture points it at a file.
    _stderr_copy = os.fdopen(os.dup(sys.stderr.fileno()), "w")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _stderr_copy is not None:
        _stderr_copy.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(
        item.config.getini("timeout") or 120)
    faulthandler.dump_traceback_later(timeout + HANG_MARGIN_S, exit=True, file=_stderr_copy)
    yield
    faulthandler.cancel_dump_traceback_later()


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


async def until_waiting(group: p2pcoll.Group, seq: int) -> None:
    """Until ``group``'s collective ``seq`` waits for a peer's message."""
    from p2pcoll.types import OpKey

    while not group.session.matcher.waiting_on(OpKey(seq)):
        await asyncio.sleep(0.005)


async def newcomer_arrives(url: str, arrived: asyncio.Event, timeout: float = 20.0) -> None:
    """Set ``arrived`` once a peer waits at the elastic job's rendezvous ``url`` for the next
    group (asked through the protocol itself). An elastic job's survivors wait on it before
    they go on: their rounds could otherwise finish the job before the newcomer is there
    (which then waits alone for its join timeout)."""
    from p2pcoll.rendezvous.client import waiting

    while True:
        try:
            if await waiting(url, timeout=timeout) > 0:
                break
        except p2pcoll.RendezvousError:  # nobody hosts it now (the newcomer will, if need be)
            pass
        await asyncio.sleep(0.01)
    arrived.set()


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


CHILD_WAIT_S = 60  # the longest one step of a ScriptChild may take before it counts as a hang


class ScriptChild:
    """A test module run as a script in a child process (a host or an attacker of a probe
    test), driven by lines on its stdin and reporting JSON lines (``{"event": ...}``) on
    its stdout; its stderr goes to a file, whose tail failures show."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.proc, self.stderr = proc, stderr

    @classmethod
    async def start(cls, script: str, tmp_path: Path, name: str, *args: str,
                    env: dict[str, str] | None = None) -> ScriptChild:
        """Run ``script`` with ``args``, in this environment less its ``P2PCOLL_*``
        variables, plus ``env``."""
        stderr = tmp_path / f"{name}.stderr"
        full = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
        full.update(env or {})
        with stderr.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, script, *args, env=full, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=err)
        return cls(proc, stderr)

    def tail(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:]

    async def read(self, event: str) -> dict[str, Any]:
        return await self.read_any((event,))

    async def read_any(self, events: tuple[str, ...]) -> dict[str, Any]:
        """The next report of one of ``events`` (others are passed over; a ``stuck`` one
        fails the test)."""
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), CHILD_WAIT_S)
            assert line, f"the process ended while {events} was awaited:\n{self.tail()}"
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") in events:
                return msg
            assert msg.get("event") != "stuck", msg

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")

    async def ask(self, command: str) -> dict[str, Any]:
        """Send ``command`` and return the report of the event of the same name."""
        self.send(command)
        return await self.read(command)

    async def finish(self, command: str | None = None) -> int:
        """Send ``command``, if any, and return the exit code once it has ended."""
        if command is not None:
            self.send(command)
        return await asyncio.wait_for(self.proc.wait(), CHILD_WAIT_S)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
