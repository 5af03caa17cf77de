"""Start N local processes that form one p2pcoll group, like torchrun or mpirun on one host.

    p2pcoll launch -n 4 -- python train.py

Each child gets the environment :func:`p2pcoll.join` reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``P2PCOLL_RENDEZVOUS``, ``P2PCOLL_KEY_FILE``, ``P2PCOLL_LAUNCHED``) and ``PYTHONUNBUFFERED=1``.
Rank 0's ``join`` hosts the rendezvous, so the launcher itself only starts, watches and stops
processes:

- Threads: as torchrun does, when there is more than one rank and ``OMP_NUM_THREADS`` is not
  set, every rank gets ``OMP_NUM_THREADS=1`` and the launcher says so once on stderr. N ranks
  of torch each using every core would overload the host, and a reduction's result depends
  on torch's thread count: the same script gives the same numbers under ``p2pcoll launch``
  and under ``torchrun``. A value the user set (in the environment or ``extra_env``) is kept.
- Settings errors: ``P2PCOLL_LAUNCHED=1`` tells :func:`p2pcoll.join` that it runs under this
  launcher, where a :class:`~p2pcoll.SettingsError` left uncaught is printed as one line
  (where join was called, and the message) instead of a traceback from every rank. Every
  other uncaught error keeps its full traceback.

- Security: secure by default. The launcher makes an ephemeral job key for its ranks, in a
  0600 file of a 0700 directory of its own, hands it over by path (``P2PCOLL_KEY_FILE``),
  and removes it when it exits; so every socket of the job runs CurveZMQ and nothing else
  on the host or the network can join or read it. A ``P2PCOLL_KEY_FILE`` already in the
  environment is used instead (the job's key, for peers on other hosts too); ``secure=False``
  (``--insecure``) gives plain sockets.

- Output: each line a child writes is prefixed with its rank (``[2] loss 0.1``), its stdout
  on our stdout and its stderr on our stderr. Children read stdin from ``/dev/null``.
  Output goes out in whole lines: whatever ends in a newline at once, and the rest of a
  rank's line waits for its newline (its end of output, or ``MAX_PARTIAL`` bytes), however
  long the writes of a line printed in pieces (``print(a, b)`` under ``-u`` writes each
  piece on its own) are apart under load; so 64 ranks printing together give whole lines.
  Only a line being redrawn (a ``\r`` in it: a progress bar) goes out before its newline,
  after ``PARTIAL_DELAY`` (50 ms, for its redraw to complete), so a bar on rank 0 stays
  live. The prefix starts every line and follows
  every ``\r``, so a bar's redraws keep their ``[0] ``. A line is never shared by two ranks:
  if one writes while another's line is open (a bar not yet finished), the open line is
  ended and the newcomer starts a fresh one; the bar goes on, prefixed, on a line below.
  Holding it back instead would keep the other ranks' output waiting until the bar ends.
- Failure: the first child to exit non-zero gives the exit code (128+signum if a signal killed
  it). The others get SIGTERM, then SIGKILL after ``grace`` seconds.
- Signals: SIGINT, SIGTERM and SIGHUP are forwarded to every child, which gets ``grace``
  seconds to exit before SIGKILL; a second signal kills at once. The launcher then says how
  each rank ended, one line per rank, and returns 128+signum. SIGINT is passed on as
  SIGTERM: a terminal's Ctrl-C reaches only the launcher (each child leads its own session),
  and SIGTERM stops a Python rank quietly where SIGINT would make every rank print a
  KeyboardInterrupt traceback. A program that cleans up on Ctrl-C should do it on SIGTERM
  too, which is what SLURM, Kubernetes and ``docker stop`` send.
- Timeline: with ``$P2PCOLL_TIMELINE=PATH`` every rank writes its own trace beside
  ``PATH``; once they have exited (however they ended) the launcher merges the files this
  run wrote into ``PATH``, one track per rank (:mod:`p2pcoll.engine.timeline`).
- No orphans: each child leads its own process group, and it is the group that is signalled,
  so whatever a child started stops with it; once every child has exited, what is left in
  their groups is killed. On Linux a child also dies if the launcher is killed outright
  (``PR_SET_PDEATHSIG``).

POSIX only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

from .engine.timeline import merge, rank_files
from .rendezvous import parse_url
from .security import write_key_file
from .transport.endpoints import free_port

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LAUNCHER_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "P2PCOLL_RENDEZVOUS", "P2PCOLL_LAUNCHED",
})
OMP_THREADS_NOTE = (
    "OMP_NUM_THREADS=1 for every rank, as torchrun sets it, so that {n} ranks do not overload "
    "the host and results do not depend on the launcher; set OMP_NUM_THREADS to choose another"
)
DRAIN_TIMEOUT = 2.0  # seconds to wait for output still in the pipes once every child exited
PARTIAL_DELAY = 0.05  # seconds a redrawn line (a \r, no newline yet) waits for its redraw
MAX_PARTIAL = 1 << 20  # bytes of a line without its newline held back at most (per rank)
_LINE_BREAK = re.compile(rb"(\r|\n)")


def launch(
    n: int,
    command: Sequence[str],
    *,
    rendezvous: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    prefix_output: bool = True,
    grace: float = 5.0,
    secure: bool = True,
) -> int:
    """Run ``command`` as ranks 0..n-1 of one group on this host and wait for all of them.

    Args:
        n: the number of processes (the world size).
        command: the program and its arguments, run as is (no shell).
        rendezvous: ``tcp://HOST:PORT`` for the children to meet at; default a free port on
            127.0.0.1. Rank 0 hosts it, unless something else already listens there.
        extra_env: more environment variables for every child (not the ones listed above).
        prefix_output: prefix each output line with ``[rank] ``; if False the children write
            straight to our stdout and stderr.
        grace: seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        secure: give the ranks a job key (an ephemeral one, unless ``$P2PCOLL_KEY_FILE``
            names one); False: plain sockets, and ``P2PCOLL_KEY_FILE`` is not passed on.

    Returns:
        0 if every child exited 0; else the exit code of the first one that did not
        (128+signum if a signal killed it); 128+signum if the launcher was sent signum;
        127 (126) if the command was not found (not executable).

    Raises:
        ValueError: n < 1, an empty command, a negative grace, or ``extra_env`` setting a
            variable the launcher sets per rank.
        RendezvousError: ``rendezvous`` is not ``tcp://HOST:PORT``.

    It runs its own event loop (``asyncio.run``), so call it from synchronous code.
    """
    if n < 1:
        raise ValueError(f"need at least one process, got n={n}")
    if not command:
        raise ValueError("no command to launch")
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    clash = sorted(LAUNCHER_VARS.intersection(extra_env or {}))
    if clash:
        raise ValueError(f"extra_env may not set {', '.join(clash)}: the launcher sets them")
    if rendezvous is None:
        host, port = "127.0.0.1", free_port("127.0.0.1")
        rendezvous = f"tcp://{host}:{port}"
    else:
        host, port = parse_url(rendezvous)
    base = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if n > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"
        print(f"p2pcoll launch: {OMP_THREADS_NOTE.format(n=n)}", file=sys.stderr, flush=True)
    given_key = base.pop("P2PCOLL_KEY_FILE", "").strip()
    with contextlib.ExitStack() as cleanup:
        if secure:
            base["P2PCOLL_KEY_FILE"] = given_key or cleanup.enter_context(_ephemeral_key())
        envs = _rank_envs(n, base, host, port, rendezvous)
        started = time.time()
        try:
            return asyncio.run(_Job(list(command), envs, prefix_output, grace).run())
        finally:
            timeline = base.get("P2PCOLL_TIMELINE", "").strip()
            if timeline:
                _merge_timeline(timeline, started)


def _merge_timeline(path: str, since: float) -> None:
    """Merge the rank files of timeline ``path`` that this run wrote (modified since it
    started; older ones are another run's) and say where the result is."""
    files = [f for f in rank_files(path) if f.stat().st_mtime >= since - 1]
    if not files:
        return
    try:
        count = merge(path, files)
    except (OSError, ValueError) as exc:
        print(f"p2pcoll launch: could not merge the timeline into {path}: {exc}",
              file=sys.stderr)
        return
    print(f"p2pcoll launch: timeline of {count} ranks in {path} (open it in "
          "https://ui.perfetto.dev)", file=sys.stderr)


@contextlib.contextmanager
def _ephemeral_key() -> Iterator[str]:
    """A new job key in a 0600 file of a private directory, removed afterwards."""
    folder = tempfile.mkdtemp(prefix="p2pcoll-key-")  # mode 0700
    path = os.path.join(folder, "job.key")
    try:
        write_key_file(path)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _rank_envs(n: int, base: Mapping[str, str], host: str, port: int, rendezvous: str
               ) -> list[dict[str, str]]:
    return [
        {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
            "P2PCOLL_RENDEZVOUS": rendezvous,
            "P2PCOLL_LAUNCHED": "1",
        }
        for rank in range(n)
    ]



def exit_code(returncode: int) -> int:
    """A shell-style exit code: a death by signal s (returncode -s) becomes 128+s."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {exit_code(returncode)})"
    return f"exited with code {returncode}"


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn making the child get SIGKILL when the launcher dies (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()
    pr_set_pdeathsig = ctypes.c_int(1)
    sigkill = ctypes.c_ulong(signal.SIGKILL)
    zero = ctypes.c_ulong(0)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigkill, zero, zero, zero)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


class _Output:
    """Our stdout and stderr, shared by every child: prefixes lines and keeps each line to one rank.

    A line is *open* while its last byte written is not a newline (a progress bar, say). If
    another child, the other stream of the same child, or the launcher writes to the same
    screen meanwhile, the open line is ended first and the newcomer starts a fresh one; the
    interrupted child gets a fresh, prefixed line when it writes again. stdout and stderr
    count as one screen when they are the same file (a terminal, or ``2>&1``).
    """

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._streams = {1: stdout, 2: stderr}
        self._screen = {1: 1, 2: 1 if _same_file(stdout, stderr) else 2}
        self._open: dict[int, tuple[int, bytes]] = {}  # screen -> (fd, prefix) of its open line
        self._at_start: dict[int, bool] = {}  # screen -> its open line's cursor is after a \r
        self._broken: set[int] = set()

    def write(self, fd: int, prefix: bytes, data: bytes) -> None:
        """Write what a child wrote to ``fd``: ``prefix`` before each line and after each \\r."""
        screen, writer = self._screen[fd], (fd, prefix)
        if self._open.get(screen, writer) != writer:
            self.end_line(screen)
        at_start = self._at_start.get(screen, True)
        out = bytearray()
        for piece in _LINE_BREAK.split(data):
            if piece in (b"\n", b"\r"):
                out += piece
                at_start = True
            elif piece:
                out += prefix if at_start else b""
                out += piece
                at_start = False
        if out.endswith(b"\n"):
            self._open.pop(screen, None)
            self._at_start.pop(screen, None)
        elif out:
            self._open[screen] = writer
            self._at_start[screen] = at_start
        self._write(fd, bytes(out))

    def end_line(self, screen: int, writer: tuple[int, bytes] | None = None) -> None:
        """End the line open on ``screen`` (only if ``writer`` holds it, when given)."""
        holder = self._open.get(screen)
        if holder is not None and writer in (None, holder):
            del self._open[screen], self._at_start[screen]
            self._write(holder[0], b"\n")

    def finish(self, fd: int, prefix: bytes) -> None:
        """A child closed ``fd``: end its line if it left one open."""
        self.end_line(self._screen[fd], (fd, prefix))

    def say(self, message: str) -> None:
        """A line of the launcher's own on stderr."""
        self.end_line(self._screen[2])
        self._write(2, f"p2pcoll launch: {message}\n".encode())

    def _write(self, fd: int, data: bytes) -> None:
        if fd in self._broken or not data:
            return
        stream = self._streams[fd]
        try:
            buffer = getattr(stream, "buffer", None)
            stream.flush()
            if buffer is None:
                stream.write(data.decode(errors="replace"))
                stream.flush()
            else:
                buffer.write(data)
                buffer.flush()
        except (BrokenPipeError, ValueError):  # closed pipe or closed stream
            self._broken.add(fd)


def _same_file(a: TextIO, b: TextIO) -> bool:
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (OSError, ValueError):  # no file descriptor behind it (pytest's capsys, say)
        return False


class _Child(asyncio.SubprocessProtocol):
    """One child process: passes its output on as it comes, prefixed, and notes its exit.

    Whatever ends in a newline is passed on at once. A piece after the last newline (a
    line printed in several writes) waits for the rest of its line; only one with a ``\r``
    in it (a progress bar being redrawn) goes out as it is after ``PARTIAL_DELAY``, and one
    of ``MAX_PARTIAL`` bytes at once.
    """

    def __init__(self, rank: int, prefix: bytes, output: _Output) -> None:
        loop = asyncio.get_running_loop()
        self.rank = rank
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()  # exited and pipes closed
        self._prefix = prefix
        self._output = output
        self._partial = {1: bytearray(), 2: bytearray()}
        self._timers: dict[int, asyncio.TimerHandle] = {}

    @property
    def pid(self) -> int:
        assert self.transport is not None
        return self.transport.get_pid()

    @property
    def returncode(self) -> int | None:
        assert self.transport is not None
        return self.transport.get_returncode()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        pending = self._partial[fd]
        pending += data
        end = pending.rfind(b"\n") + 1
        if end:
            self._output.write(fd, self._prefix, bytes(pending[:end]))
            del pending[:end]
        if len(pending) >= MAX_PARTIAL:
            self._flush(fd)
        if not pending and fd in self._timers:
            self._timers.pop(fd).cancel()
        elif b"\r" in pending and fd not in self._timers:
            loop = asyncio.get_running_loop()
            self._timers[fd] = loop.call_later(PARTIAL_DELAY, self._flush, fd)

    def _flush(self, fd: int) -> None:
        timer = self._timers.pop(fd, None)
        if timer is not None:
            timer.cancel()  # harmless when it is the timer running this
        pending = self._partial[fd]
        if pending:
            self._output.write(fd, self._prefix, bytes(pending))
            pending.clear()

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd in self._timers:
            self._timers.pop(fd).cancel()
        self._flush(fd)
        self._output.finish(fd, self._prefix)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class _Job:
    """The children of one launch, and what happens to them."""

    def __init__(
        self, command: list[str], envs: list[dict[str, str]], prefix_output: bool, grace: float
    ) -> None:
        self._command = command
        self._envs = envs
        self._prefix_output = prefix_output
        self._grace = grace
        self._preexec = _die_with_parent()
        self._output = _Output(sys.stdout, sys.stderr)
        self._children: list[_Child] = []
        self._failure: int | None = None  # exit code of the first child that failed
        self._interrupted: int | None = None  # the first signal the launcher got
        self._stopping = False
        self._kill_timer: asyncio.TimerHandle | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        previous = self._forward_signals(loop)
        try:
            for rank, env in enumerate(self._envs):
                if self._stopping:
                    break
                try:
                    self._children.append(await self._spawn(rank, env))
                except OSError as exc:
                    self._say(f"cannot run {self._command[0]!r}: {exc.strerror or exc}")
                    self._failure = 127 if isinstance(exc, FileNotFoundError) else 126
                    self._stop(signal.SIGTERM)
            await asyncio.gather(*(self._watch(child) for child in self._children))
            self._sweep()
            if self._children:
                await asyncio.wait([c.closed for c in self._children], timeout=DRAIN_TIMEOUT)
            if self._interrupted is not None:
                for child in self._children:
                    assert child.returncode is not None
                    self._say(f"rank {child.rank} {_describe_exit(child.returncode)}")
        finally:
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            for child in self._children:  # on cancellation this kills what still runs
                if child.returncode is None:
                    self._signal(child, signal.SIGKILL)
                assert child.transport is not None
                child.transport.close()
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                if handler is not None:  # None: installed from C, cannot be restored
                    signal.signal(sig, handler)
        if self._failure is not None:
            return self._failure
        if self._interrupted is not None:
            return 128 + self._interrupted
        return 0

    async def _spawn(self, rank: int, env: dict[str, str]) -> _Child:
        loop = asyncio.get_running_loop()
        width = len(str(len(self._envs) - 1))
        prefix = f"[{rank:>{width}}] ".encode()
        pipe = subprocess.PIPE if self._prefix_output else None
        child = _Child(rank, prefix, self._output)
        await loop.subprocess_exec(
            lambda: child, *self._command,
            stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, env=env,
            start_new_session=True, preexec_fn=self._preexec,
        )
        return child

    async def _watch(self, child: _Child) -> None:
        await child.exited
        returncode = child.returncode
        assert returncode is not None
        if returncode == 0 or self._stopping:
            return
        self._failure = exit_code(returncode)
        running = sum(c.returncode is None for c in self._children)
        others = f"; stopping the other {running}" if running else ""
        self._say(f"rank {child.rank} {_describe_exit(returncode)}{others}")
        self._stop(signal.SIGTERM)

    def _forward_signals(self, loop: asyncio.AbstractEventLoop) -> dict[int, Any]:
        """Route SIGINT/SIGTERM/SIGHUP to the children; returns the handlers it replaced."""
        previous: dict[int, Any] = {}
        for sig in FORWARDED_SIGNALS:
            handler = signal.getsignal(sig)
            if handler is signal.SIG_IGN:  # e.g. SIGHUP under nohup: the children inherit it
                continue
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (ValueError, RuntimeError):  # not the main thread: nothing to forward
                break
            previous[sig] = handler
        return previous

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._interrupted is None:
            self._interrupted = sig
        if self._stopping:
            self._say(f"got {name} again; killing every rank")
            self._signal_all(signal.SIGKILL)
        elif sig == signal.SIGINT:  # SIGTERM: no KeyboardInterrupt traceback from every rank
            self._say(f"got {name}; passing it on to every rank as SIGTERM")
            self._stop(signal.SIGTERM)
        else:
            self._say(f"got {name}; passing it on to every rank")
            self._stop(sig)

    def _stop(self, sig: int) -> None:
        """Send ``sig`` to every child still running, and SIGKILL after the grace period."""
        if self._stopping:
            return
        self._stopping = True
        self._signal_all(sig)
        loop = asyncio.get_running_loop()
        self._kill_timer = loop.call_later(self._grace, self._signal_all, signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        for child in self._children:
            if child.returncode is None:
                self._signal(child, sig)

    @staticmethod
    def _signal(child: _Child, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, sig)  # the child leads its own process group

    def _sweep(self) -> None:
        """Kill whatever the (exited) children left running in their process groups."""
        for child in self._children:
            self._signal(child, signal.SIGKILL)

    def _say(self, message: str) -> None:
        self._output.say(message)
