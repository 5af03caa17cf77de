"""A peer for tests/test_flight_processes.py, on the blocking API; ``argv[1]`` says what
it does after three allreduces:

- ``mismatch``: rank 1 calls broadcast where the others call allreduce;
- ``stop``: rank 1 stops itself (SIGSTOP) and the others call allreduce;
- ``usr1``: report ready, then wait (at most a minute) until its record file is there
  (written on the test's SIGUSR1).

It prints ``{"failed": "<error class>"}`` when its call fails, ``{"ready": n}`` (n: the
entries its record holds) when it waits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

from p2pcoll import P2PCollError, blocking


def say(key: str, value: object) -> None:
    print(json.dumps({key: value}), flush=True)


def main() -> None:
    mode = sys.argv[1]
    g = blocking.join()
    x = np.ones(1024, dtype=np.float32)
    for _ in range(3):
        g.allreduce(x)
    try:
        if mode == "mismatch":
            if g.rank == 1:
                g.broadcast(x, root=0)
            else:
                g.allreduce(x)
        elif mode == "stop":
            if g.rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            g.allreduce(x)
        elif mode == "usr1":
            say("ready", len(g.flight_record()))
            path = os.path.join(os.environ["P2PCOLL_FLIGHT_DIR"], f"rank-{g.rank}.json")
            deadline = time.monotonic() + 60
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.02)
            g.barrier()
    except P2PCollError as exc:
        say("failed", type(exc).__name__)
    g.close()


if __name__ == "__main__":
    main()
