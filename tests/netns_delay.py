"""The lab's packet delayer: ``nfq_delay.c`` built with this machine's C compiler and run in
a lab's switch namespace, where every IPv4 packet crossing the switch waits in a netfilter
queue for a fixed delay (see that file's comment, and :meth:`netns.Lab.delay_packets`).

The kernel keeps the packets; the delayer sees only their ids and arrival stamps and gives
each its verdict ``delay`` after it arrived, so TCP on the hosts sees the real round trip:
its windows, slow start and striping feel the delay as over a long cable. It needs a C
compiler (``cc``, or ``$CC``), ``iptables`` with the NFQUEUE target, the kernel's
nfnetlink queue and bridge netfilter (``CONFIG_NETFILTER_NETLINK_QUEUE``,
``CONFIG_BRIDGE_NETFILTER``); :func:`unavailable` says which is missing where it can tell
before trying. The binary is built once per version of the source into a directory of
this user's under the temporary directory (``p2pcoll-lab-<uid>``) and reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("nfq_delay.c")
QUEUE = 0  # the queue's number in its switch's namespace (each namespace has its own)
MAXLEN = 1 << 18  # packets the queue may hold: 4 Gbit/s x 100 ms of full-size frames, twice


class DelayError(RuntimeError):
    """The delayer could not be built or started (what failed, and its output)."""


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name)) is not None:
            return path
    return None


def unavailable() -> str | None:
    """Why the delayer cannot run here (no compiler, no ``iptables``, no source), or None
    if it may be tried (the kernel may still refuse the queue: :func:`start` says so)."""
    if not SOURCE.is_file():
        return f"{SOURCE} is missing"
    if _compiler() is None:
        return "no C compiler (cc, gcc or $CC) to build the packet delayer"
    if shutil.which("iptables") is None:
        return "`iptables` is not installed: apt-get install -y iptables"
    return None


def _cache() -> Path:
    """This user's directory for the built delayer: made 0700, refused if anyone else owns
    it or may write to it (the temporary directory is shared)."""
    path = Path(tempfile.gettempdir()) / f"p2pcoll-lab-{os.geteuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise DelayError(f"{path} is not a private directory of this user")
    return path


def binary() -> Path:
    """The built delayer (built now if this version of the source has not been yet).

    Raises:
        DelayError: no compiler, or the compiler failed (its output).
    """
    source = SOURCE.read_bytes()
    built = _cache() / f"nfq_delay-{hashlib.sha256(source).hexdigest()[:16]}"
    if built.is_file():
        return built
    cc = _compiler()
    if cc is None:
        raise DelayError("no C compiler (cc, gcc or $CC) to build the packet delayer")
    partial = built.with_name(f"{built.name}.{os.getpid()}")
    done = subprocess.run([cc, "-O2", "-Wall", "-o", str(partial), str(SOURCE)],
                          capture_output=True, text=True, check=False, timeout=120)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise DelayError(f"{cc} could not build {SOURCE.name}: {done.stderr.strip()}")
    partial.replace(built)  # atomic: a concurrent build of the same source is the same file
    return built


def start(namespace: str, delay: float) -> subprocess.Popen[str]:
    """Run the delayer in ``namespace`` and send every IPv4 packet the namespace forwards
    (bridged ones too) through it, ``delay`` seconds each; returns its process (its pid is
    the delayer's own). Killing it drops what it holds and stops all forwarding (no bypass).

    Raises:
        DelayError: it could not be built, the kernel refused the queue, or ``iptables``
            or the bridge's netfilter setting was refused (their messages).
    """
    argv = ["ip", "netns", "exec", namespace, str(binary()), str(QUEUE),
            str(round(delay * 1e6)), str(MAXLEN)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise DelayError(f"the packet delayer did not start in {namespace}: {err.strip()}")
    steps = [
        # Bridged frames cross iptables' FORWARD only with this on (br_netfilter).
        ["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"],
        # No --queue-bypass: without the delayer nothing passes, rather than passing early.
        ["iptables", "-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", str(QUEUE)],
    ]
    for step in steps:
        done = subprocess.run(["ip", "netns", "exec", namespace, *step], capture_output=True,
                              text=True, check=False, timeout=30)
        if done.returncode != 0:
            proc.kill()
            proc.communicate(timeout=10)
            raise DelayError(f"`{' '.join(step)}` failed in {namespace}: "
                             f"{done.stderr.strip() or done.returncode}")
    return proc


def dropped(namespace: str) -> int:
    """Packets the delayer's queue in ``namespace`` has dropped (queue full, or its socket's
    buffer full); 0 where it has none."""
    done = subprocess.run(["ip", "netns", "exec", namespace, "cat",
                           "/proc/net/netfilter/nfnetlink_queue"], capture_output=True,
                          text=True, check=False, timeout=30)
    total = 0
    for line in done.stdout.splitlines():
        fields = line.split()  # queue, portid, held, mode, range, dropped, user dropped, ...
        if len(fields) >= 7 and fields[0] == str(QUEUE):
            total += int(fields[5]) + int(fields[6])
    return total
