"""How faithful the lab's delay is: round trips, and one TCP stream against window / RTT.

    python benchmarks/lab_delay.py                            # 1gbit, 50 ms, nfqueue and relay
    python benchmarks/lab_delay.py --ways nfqueue --buffers 256K,1M,4M,16M --seconds 6

Not a test: it prints a table. Needs root, ``ip``/``tc``, and for each of ``--ways``: the
lab's packet delayer (``nfqueue``: a C compiler, iptables) or its stream relay (``relay``:
nftables). Two hosts of their own (``tests/netns.py``), every cable a token bucket of
``--rate`` each way, ``--delay`` one way made each of ``--ways`` in a lab of its own:

- round trip: 1-byte TCP messages to an echo (TCP_NODELAY), min and median of 50;
- one TCP stream, host 0 to host 1, for each socket buffer of ``--buffers`` (the receiver's
  SO_RCVBUF; the sender's SO_SNDBUF four times that so it does not bind) and ``auto`` (no
  setsockopt: the kernel's autotuning, what p2pcoll's sockets get): throughput over the
  last ``--seconds`` after a ``--warmup``, the receive window the sender saw (TCP_INFO's
  snd_wnd, median of samples) and what theory gives, ``min(line rate, window / RTT)`` with
  RTT twice the delay, and the share of the time the sender was limited by the receive
  window or by its own buffer (TCP_INFO's rwnd_limited, sndbuf_limited);
- the CPU the delayer (or the relays) used during the stream, as a share of one core.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path

PORT = 29720
PAYLOAD_PER_FRAME = 1448 / 1514
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # asm-generic/socket.h (root may exceed the maxima)


# --- the workers (on a host of the lab) ------------------------------------------------------

def tcp_info(sock: socket.socket) -> dict[str, int]:
    """The fields of linux/tcp.h's struct tcp_info this script reads."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    rtt, = struct.unpack_from("I", raw, 68)
    acked, = struct.unpack_from("Q", raw, 120)
    busy, rwnd, sndbuf = struct.unpack_from("QQQ", raw, 168)
    snd_wnd, = struct.unpack_from("I", raw, 228) if len(raw) >= 232 else (0,)
    return {"rtt_us": rtt, "acked": acked, "busy_us": busy, "rwnd_us": rwnd,
            "sndbuf_us": sndbuf, "snd_wnd": snd_wnd}


def serve(args: argparse.Namespace) -> None:
    """Echo what arrives on connections to PORT (the round trips), and count what arrives
    on PORT + 1 (the stream's sink), until killed."""
    import threading

    def echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(1 << 16):
            conn.sendall(data)

    def sink(conn: socket.socket) -> None:
        while conn.recv(1 << 20):
            pass

    listeners = []
    for port, handler in ((PORT, echo), (PORT + 1, sink)):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if port == PORT + 1 and args.buffer:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, args.buffer)
        sock.bind(("0.0.0.0", port))
        sock.listen(16)
        listeners.append((sock, handler))

    def accept(sock: socket.socket, handler: Any) -> None:
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    for sock, handler in listeners:
        threading.Thread(target=accept, args=(sock, handler), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


def ping(args: argparse.Namespace) -> dict[str, Any]:
    sock = socket.create_connection((args.to, PORT))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(50):
        t = time.perf_counter()
        sock.sendall(b"x")
        sock.recv(1)
        rtts.append(time.perf_counter() - t)
        time.sleep(0.01)
    return {"rtt_ms": [r * 1e3 for r in rtts]}


def stream(args: argparse.Namespace) -> dict[str, Any]:
    sock = socket.socket()
    if args.buffer:
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 * args.buffer)
    sock.connect((args.to, PORT + 1))
    chunk = b"\0" * (1 << 16)
    started = time.monotonic()
    first: dict[str, int] | None = None
    windows = []
    next_sample = started + args.warmup
    while (now := time.monotonic()) < started + args.warmup + args.seconds:
        sock.send(chunk)
        if now >= next_sample:
            info = tcp_info(sock)
            if first is None:
                first, t0 = info, now
            windows.append(info["snd_wnd"])
            next_sample = now + 0.05
    last, t1 = tcp_info(sock), time.monotonic()
    assert first is not None
    sock.close()
    span = t1 - t0
    return {"Bps": (last["acked"] - first["acked"]) / span, "snd_wnd": statistics.median(windows),
            "rtt_ms": last["rtt_us"] / 1e3,
            "rwnd_limited": (last["rwnd_us"] - first["rwnd_us"]) / 1e6 / span,
            "sndbuf_limited": (last["sndbuf_us"] - first["sndbuf_us"]) / 1e6 / span}


# --- the driver ------------------------------------------------------------------------------

def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def worker(lab: netns.Lab, rank: int, argv: list[str]) -> dict[str, Any]:
    done = subprocess.run(lab.command(rank, [sys.executable, __file__, *argv]),
                          capture_output=True, text=True, check=True, timeout=300)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def measure(args: argparse.Namespace, way: str, line: float) -> list[list[str]]:
    rows = []
    with netns.Lab(2) as lab:
        lab.shape(args.rate, burst=args.burst)
        delay = netns.seconds(args.delay)
        if way == "nfqueue":
            lab.delay_packets(delay)
            helpers = [lab.delayer.pid] if lab.delayer is not None else []
        else:
            lab.delay_streams(delay)
            helpers = [relay.pid for relay in lab._relays]
        for buffer in args.buffers:
            server = subprocess.Popen(
                lab.command(1, [sys.executable, __file__, "--worker", "serve", "--buffer",
                                str(buffer)]), stdout=subprocess.PIPE, text=True)
            try:
                assert server.stdout is not None
                server.stdout.readline()
                to = ["--to", netns.address(1), "--buffer", str(buffer)]
                if not rows:
                    rtt = worker(lab, 0, ["--worker", "ping", *to])["rtt_ms"]
                    rows.append([way, "round trip", f"{min(rtt):.2f} ms min, "
                                 f"{statistics.median(rtt):.2f} median, "
                                 f"{max(rtt):.2f} max", f"{2 * delay * 1e3:.2f} ms", "", ""])
                cpu = cpu_seconds(helpers)
                t = time.monotonic()
                got = worker(lab, 0, ["--worker", "stream", *to, "--seconds",
                                      str(args.seconds), "--warmup", str(args.warmup)])
                cpu_share = (cpu_seconds(helpers) - cpu) / (time.monotonic() - t)
            finally:
                server.kill()
                server.wait()
            theory = min(line, got["snd_wnd"] / (2 * delay))
            rows.append([
                way, f"{buffer >> 10} KiB" if buffer else "auto",
                f"{got['Bps'] * 8 / 1e6:.0f} Mbit/s (rtt {got['rtt_ms']:.1f} ms)",
                f"{theory * 8 / 1e6:.0f} Mbit/s (window {got['snd_wnd'] / 2**20:.2f} MiB)",
                f"{got['rwnd_limited']:.0%} / {got['sndbuf_limited']:.0%}",
                f"{cpu_share:.0%}"])
        rows.append([way, "drops", str(lab.drops()), "", "", ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    from p2pcoll.bench.options import parse_sizes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay", default="50ms")
    parser.add_argument("--burst", default="1mbit", help="the token buckets' (1mbit: a GSO "
                        "packet passes whole)")
    parser.add_argument("--ways", default="nfqueue,relay")
    parser.add_argument("--buffers", default="256K,1M,4M,16M,auto")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--worker", choices=("serve", "ping", "stream"), help=argparse.SUPPRESS)
    parser.add_argument("--to", help=argparse.SUPPRESS)
    parser.add_argument("--buffer", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "serve":
        serve(args)
        return 0
    if args.worker is not None:
        print(json.dumps(ping(args) if args.worker == "ping" else stream(args)), flush=True)
        return 0
    reason = netns.unavailable()
    if reason is not None:
        print(f"lab_delay: {reason}", file=sys.stderr)
        return 2
    from slow_link import bits_per_second  # (beside this file)

    args.buffers = [0 if b.strip() == "auto" else parse_sizes(b)[0]
                    for b in args.buffers.split(",")]
    line = bits_per_second(args.rate) * PAYLOAD_PER_FRAME / 8
    load = os.getloadavg()[0]
    rows = []
    for way in args.ways.split(","):
        rows += measure(args, way.strip(), line)
    print(f"2 lab hosts, cables {args.rate} (burst {args.burst}), {args.delay} one way; "
          f"load {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("| delay | socket buffer | measured | theory: min(line, window / 2 delay) | "
          "rwnd / sndbuf limited | delayer CPU |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
