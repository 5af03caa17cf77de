"""``p2pcoll launch``: output passed on as it comes (progress bars stay live), and a quiet Ctrl-C."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
PAUSE = 0.5  # seconds between the pieces a child writes: far more than PARTIAL_DELAY


def read_until(proc: subprocess.Popen[bytes], done: Callable[[bytes], bool],
               timeout: float = 30) -> bytes:
    """What ``proc`` wrote to stdout, read as it comes, until ``done`` of it holds (or EOF)."""
    assert proc.stdout is not None
    fd, got = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while not done(got):
        left = deadline - time.monotonic()
        assert left > 0, f"still waiting after {timeout}s; got {got!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            got += chunk
    return got


BAR = f"""
import sys, time
for piece in ["\\r10%", "\\r50%", "\\r100%\\n"]:
    sys.stdout.write(piece)
    sys.stdout.flush()
    time.sleep({PAUSE})
"""


def test_partial_lines_arrive_live_and_every_carriage_return_keeps_the_prefix() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "1", "--", sys.executable, "-c", BAR],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    ) as proc:
        try:
            early = read_until(proc, lambda got: b"50%" in got)
            assert proc.poll() is None, "the pieces came only once the child had ended"
            assert b"100%" not in early
            rest, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    assert early + rest == b"\r[0] 10%\r[0] 50%\r[0] 100%\n"


TWO_WRITERS = f"""
import os, sys, time
if os.environ["RANK"] == "0":
    sys.stdout.write("\\r10%")
    sys.stdout.flush()
    time.sleep({2 * PAUSE})
    sys.stdout.write("\\r100%\\n")
else:
    time.sleep({PAUSE})
    print("hello", "from", 1)
"""


def test_a_rank_writing_while_another_line_is_open_gets_a_fresh_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--",
         sys.executable, "-c", TWO_WRITERS],
        capture_output=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"\r[0] 10%\n[1] hello from 1\n\r[0] 100%\n"


def test_ctrl_c_ends_with_one_line_per_rank_and_no_traceback() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "3", "--",
         sys.executable, "-c", "import time; print('up', flush=True); time.sleep(1e6)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True,
    ) as launcher:
        try:
            read_until(launcher, lambda got: got.count(b"] up\n") == 3)
            os.killpg(launcher.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
            start = time.monotonic()
            _, err = launcher.communicate(timeout=10)
            elapsed = time.monotonic() - start
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGINT
    assert elapsed < 5, f"the ranks took {elapsed:.1f}s to stop"
    text = err.decode()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    lines = [line for line in text.splitlines() if "OMP_NUM_THREADS=1" not in line]  # the note
    assert lines[0] == "p2pcoll launch: got SIGINT; passing it on to every rank as SIGTERM"
    assert lines[1:] == [
        f"p2pcoll launch: rank {r} was killed by SIGTERM (exit code 143)" for r in range(3)
    ]


PIECES = """
import os, sys, time
from pathlib import Path
here = Path(sys.argv[1])

def wait_for(name):
    while not (here / name).exists():
        time.sleep(0.01)

if os.environ["RANK"] == "0":
    wait_for("up1")
    sys.stdout.write("R")  # a line in pieces, as print("R", 21, True, 93) under -u writes it
    (here / "r0").touch()
    wait_for("printed1")  # rank 1 printed a whole line meanwhile
    time.sleep(0.2)  # well over PARTIAL_DELAY
    for piece in [" ", "21", " ", "True", " ", "93", "\\n"]:
        sys.stdout.write(piece)
else:
    (here / "up1").touch()
    wait_for("r0")
    time.sleep(0.2)
    print("other")
    (here / "printed1").touch()
"""


def test_a_line_written_in_pieces_comes_out_whole_and_prefixed_once(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--",
         sys.executable, "-c", PIECES, str(tmp_path)],
        capture_output=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.decode().splitlines()) == ["[0] R 21 True 93", "[1] other"]


FINISH = """
import asyncio, numpy as np, p2pcoll
async def main():
    async with p2pcoll.join(timeout=120) as g:
        total = await g.allreduce(np.full(1000, g.rank, np.float64))
        await g.barrier()
        print("done", g.rank, bool(total[0] == sum(range(g.world_size))), flush=True)
asyncio.run(main())
"""
# What a launch line may say besides a rank's own output: the launcher's note on
# OMP_NUM_THREADS, and (under load) a rendezvous host's status while peers still arrive.
QUIET = ("p2pcoll launch: OMP_NUM_THREADS=1", "still waiting at the rendezvous")


def test_ranks_that_finish_and_close_normally_log_nothing_that_reads_like_a_failure() -> None:
    """Issue 35: 64 ranks that closed normally printed ``rank 55: lost the connection to
    rank 14`` and dozens like it on the way out. Every rank here finishes, closes, and
    exits 0; nothing else is said: no loss, no dropped message, no warning."""
    n = 16
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", str(n), "--", sys.executable, "-c",
         FINISH], capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")})
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, lines
    results = sorted(line.split("] ", 1)[1] for line in lines if "] done " in line)
    assert results == sorted(f"done {r} True" for r in range(n)), lines
    other = [line for line in lines if "] done " not in line and not any(q in line for q in QUIET)]
    assert not other, other
