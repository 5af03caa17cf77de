"""Time from a signal to the survivors' PeerLost, senders and receivers alike.

For each transport (tcp, ipc, same-host lanes) and signal (SIGKILL, SIGSTOP), 3 peers run
1 MiB operations in a loop (a point-to-point send/recv, a broadcast, a gather) and one is
signalled; every survivor's error and the time from the signal to it is printed as one
JSON line per case (median, range). The peers are those of tests/test_sender_loss.py.

    python benchmarks/sender_loss.py [RUNS]     # RUNS per case, 3 by default
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_sender_loss import run_case

# (what is measured, scenario, the rank that is signalled)
CASES = [("p2p send (sender)", "send", 1), ("p2p recv (receiver)", "recv", 0),
         ("broadcast root, a receiver dies (sender)", "broadcast", 2),
         ("broadcast non-roots, root dies (receivers)", "broadcast", 0),
         ("gather senders, root dies (senders)", "gather", 0),
         ("gather root, a sender dies (receiver)", "gather", 2)]


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for transport in ("tcp", "ipc", "lanes"):
        for signame in ("SIGKILL", "SIGSTOP"):
            for label, scenario, victim in CASES:
                times, errors = [], set()
                for _ in range(runs):
                    outcomes, _ = run_case(scenario, transport, getattr(signal, signame),
                                           heartbeat=5.0, deadline=300.0, victim=victim,
                                           patience=60)
                    for outcome in outcomes.values():
                        times.append(outcome["elapsed"])
                        errors.add(f'{outcome["error"]}({outcome["rank"]})')
                print(json.dumps({
                    "transport": transport, "signal": signame, "case": label,
                    "median_s": statistics.median(times) if times else None,
                    "range_s": [min(times), max(times)] if times else None,
                    "errors": sorted(errors)}), flush=True)


if __name__ == "__main__":
    main()
