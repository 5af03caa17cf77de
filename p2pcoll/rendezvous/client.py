"""The rendezvous client: register this peer's endpoints and wait for the roster.

The request is re-sent every :data:`~.protocol.RESEND` seconds (the server's sign that this
peer is alive, and how a restarted server learns of it), byte for byte the same: until the
socket connects, ZeroMQ queues the copies and then delivers them at once, as a server whose
loop stalled reads them at once, and the server takes copies of a connection's last request
over its rate bound for re-sends, never for a flood (:mod:`.admission`).
The client watches its socket's handshakes, and tells what it sees apart:

- a key the server's ZAP gate refused is an error at once (``permanent``), and so is a
  handshake that broke the protocol (something else listens there);
- that one side is secured and the other not (ZeroMQ reports the mechanism mismatch) is
  an error as soon as the probe below has said what answers: a secured client takes
  anything that is not ZeroMQ 3 (an HTTP server's answer) for a plain ZeroMQ peer;
- a connection cut during its handshake, or (without a job key) a handshake that has not
  completed after :data:`STALL` seconds, is not evidence of anything by itself: a host that
  is rebinding its port (a group re-formed, a server restarting) cuts the connections its
  old socket had accepted, and a server of another protocol that answered and keeps the
  connection open looks like a slow host. So the client asks what answers there over a
  plain connection (:mod:`.probe`: a ZeroMQ greeting names the server's security
  mechanism, whatever the load): a rendezvous secured with a job key when this peer has
  none (or the reverse), or something that is not ZeroMQ (quoted), is an error at once
  (``permanent``). Otherwise the client connects again; only when every handshake is cut
  for :data:`CUTS_PERSIST` seconds (at least :data:`CUTS` of them, none completing, and a
  probe answered) is it an error: with a job key, the server holds a different one (a
  CURVE server that cannot open a client's hello closes it without a word); without, what
  listens is not a p2pcoll rendezvous. (A secured client does not probe a handshake that
  is only slow: a probe cannot complete a CURVE handshake, and a secured server counts one
  that stops short as a refused key.)

A host that answered and then went silent for the heartbeat timeout is gone. When nothing
has answered for :data:`SILENT_WARNING` seconds, a warning says so once (naming the
address; the client keeps trying until its deadline), so a mistyped address or a host not
started yet shows within seconds rather than at the end of the join timeout. While the
group forms, every :data:`WAIT_REPORT` seconds a warning says how many peers of how many
have joined (which, and which ranks are missing) and how long this peer waits in all, and
that ``P2PCOLL_JOIN_TIMEOUT`` sets that (``P2PCOLL_TIMEOUT`` is the collectives' deadline,
a common mix-up).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..errors import RendezvousError
from ..transport.sockets import SocketFactory, monitor
from ..types import Membership
from ..wire import WIRE_VERSION
from .protocol import RESEND
from .url import parse_url

if TYPE_CHECKING:  # imported at the first probe: most joins never need one
    from .probe import Answer

log = logging.getLogger("p2pcoll.rendezvous")

SILENT_WARNING = 5.0  # seconds without any answer before a warning says so (once)
WAIT_REPORT = 10.0  # seconds between the warnings that say who the group still waits for
STALL = 1.0  # seconds a handshake may take before the client asks what answers (a probe)
PROBE_WAIT = 1.0  # seconds a probe waits for an answer

_token = secrets.token_hex(8)  # this process's, in its join requests: see _renew_token


def _renew_token() -> None:
    """A forked child is another process: it gets its own token. The server takes a join
    with this process's token for a rank it holds for it as this process asking again (its
    earlier attempt gave up) and replaces that registration; host and pid cannot tell that
    apart from another process (two containers on the host network both run pid 1)."""
    global _token
    _token = secrets.token_hex(8)


os.register_at_fork(after_in_child=_renew_token)

# Handshakes cut (closed with no reason given) before the client gives up: at least CUTS
# of them, over at least CUTS_PERSIST seconds with none completing. A host rebinding its
# port cuts one or two, within milliseconds; a server whose key differs cuts every one.
CUTS = 3
CUTS_PERSIST = 2.0
_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _reply(frames: list[bytes], url: str, ops: tuple[str, ...]) -> dict[str, Any]:
    """Decode a reply (a roster's second frame, the group's part, merged into the first);
    anything that is not a rendezvous message says who answered."""
    msg: Any = None
    if len(frames) in (1, 2):
        try:
            msg = msgpack.unpackb(frames[0], raw=False, max_bin_len=0, max_ext_len=0)
            if isinstance(msg, dict) and msg.get("op") == "roster" and len(frames) == 2:
                body = msgpack.unpackb(frames[1], raw=False, max_bin_len=0, max_ext_len=0)
                msg = {**msg, **body} if isinstance(body, dict) else None
            elif len(frames) != 1:
                msg = None
        except Exception:
            msg = None
    if not isinstance(msg, dict) or msg.get("op") not in ops:
        raise RendezvousError(
            f"something other than a p2pcoll rendezvous answered at {url} "
            f"({sum(map(len, frames))} bytes that are not a rendezvous reply)", permanent=True,
        )
    return msg


def _roster(msg: dict[str, Any], url: str, choose: Callable[[str, list[str]], str]
            ) -> Membership:
    try:
        hosts = tuple(str(h) for h in msg["hosts"])
        endpoints = [list(map(str, e)) for e in msg["endpoints"]]
        size, rank = int(msg["world_size"]), int(msg["rank"])
        if not (len(hosts) == len(endpoints) == size and 0 <= rank < size):
            raise ValueError("sizes disagree")
        secret = msg["secret"]
        if not isinstance(secret, str) or not 32 <= len(secret) <= 128:
            raise ValueError("no link secret")
        return Membership(
            group_id=str(msg["group"]), epoch=int(msg["epoch"]), rank=rank, world_size=size,
            endpoints=tuple(choose(h, e) for h, e in zip(hosts, endpoints, strict=True)),
            hosts=hosts, secret=secret,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"the rendezvous at {url} sent a malformed roster: {exc}") from None


class _Link:
    """One client socket to the rendezvous and what its handshakes said."""

    def __init__(self, url: str, sockets: SocketFactory) -> None:
        self.url = url
        self.host, self.port = parse_url(url)
        self.sock = sockets.rendezvous_client(b"j" + os.urandom(8).hex().encode())
        # Plain (not asyncio) views of the socket and its monitor: sends that must not
        # wait, and events read as they are, between polls.
        self._out = zmq.Socket.shadow(self.sock.underlying)
        self._monitor = monitor(self.sock, _EVENTS)
        self.monitor = zmq.Socket.shadow(self._monitor.underlying)
        self.secure = sockets.secure
        self.connected = False  # a TCP connection was ever made
        self.answered: float | None = None  # when the last reply came
        self._pending: float | None = None  # connected, handshake not yet done: since when
        self.cuts = 0  # handshakes cut since the last one that completed...
        self._first_cut = 0.0  # ...the first of them when
        self._doubt = False  # a handshake was cut or stalled: ask what answers
        self._mismatched = False  # libzmq reported the mechanisms differ
        self._probe: asyncio.Task[Answer] | None = None
        self._probed: Answer | None = None  # the last answer, since the last cut or stall
        self._next_probe = 0.0
        self._probe_every = 2 * PROBE_WAIT  # doubled after each probe (a silent listener)
        self.sock.connect(f"tcp://{self.host}:{self.port}")

    @property
    def mechanism(self) -> str:
        return "CURVE" if self.secure else "NULL"

    def events(self) -> None:
        """Read the monitor's events and the probe's answer (see the module docstring for
        what they mean); start a probe if a handshake was cut or stalled.

        Raises:
            RendezvousError: ``permanent``, when the keys do not fit, the handshake broke
                the protocol, something that is not ZeroMQ answers, or every handshake has
                been cut for CUTS_PERSIST seconds.
        """
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_CONNECTED:
                self.connected, self._pending = True, time.monotonic()
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._pending = None
                self.cuts = 0
                self._doubt = False
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail("it refused this peer's key", "this peer uses a job key "
                           "(P2PCOLL_KEY_FILE / key_file=) and the rendezvous holds a "
                           "different one")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                if value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    self._fail("the handshake broke the protocol",
                               "what listens there is not a p2pcoll rendezvous")
                # Evidence, but of what: a secured client takes anything that is not
                # ZeroMQ 3 (an HTTP server's answer) for a plain ZeroMQ peer. The probe's
                # answer says which, at once.
                self._mismatched, self._doubt, self._next_probe = True, True, 0.0
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or (
                    kind == zmq.EVENT_DISCONNECTED and self._pending is not None):
                self._pending = None
                self._cut()
        now = time.monotonic()
        if self._pending is not None and now - self._pending >= STALL and not self.secure:
            self._doubt = True  # (secured: see the module docstring)
        self._ask(now)

    def _ask(self, now: float) -> None:
        """Judge the probe's answer if it came; start one if in doubt and due."""
        if self._probe is not None and self._probe.done():
            answer, self._probe = self._probe.result(), None
            self._probed = answer
            self._judge(answer)
        if self._doubt and self._probe is None and now >= self._next_probe:
            self._doubt = False
            self._next_probe = now + self._probe_every
            self._probe_every *= 2
            from .probe import probe
            self._probe = asyncio.ensure_future(
                probe(self.host, self.port, self.mechanism, PROBE_WAIT))

    def _judge(self, answer: Answer) -> None:
        """An error at once if what answered cannot be this job's rendezvous."""
        if answer.kind == "other":
            raise RendezvousError(
                f"{self.url} is not a p2pcoll rendezvous: what answers there sent "
                f"{answer.quoted()} ({len(answer.sample)} bytes, not a ZeroMQ greeting); is "
                f"the address right (another service holds that port)?", permanent=True)
        if self._mismatched:
            self._mismatch()
        if answer.kind != "zmtp" or answer.mechanism == self.mechanism:
            return  # nothing that tells: the handshakes say on
        if answer.mechanism in ("NULL", "CURVE"):
            self._mismatch()
        self._fail(f"it offers the {answer.mechanism} security mechanism",
                   "what listens there is ZeroMQ but not a p2pcoll rendezvous")

    def _mismatch(self) -> None:
        self._fail("one side is secured and the other not", (
            "this peer uses a job key (P2PCOLL_KEY_FILE / key_file=): the rendezvous has "
            "none" if self.secure else "this peer has no job key: the rendezvous is "
            "secured (set P2PCOLL_KEY_FILE to the job's key file)"))

    def _cut(self) -> None:
        """A handshake was cut: an error only when it keeps happening (and a probe, asked
        since the first cut, found nothing more telling)."""
        now = time.monotonic()
        if self.cuts == 0:
            self._first_cut = now
            self._probed = None
        self.cuts += 1
        self._doubt = True
        if (self.cuts >= CUTS and now - self._first_cut >= CUTS_PERSIST
                and self._probed is not None):
            self._fail(
                f"it closed every handshake for {now - self._first_cut:.1f}s, {self.cuts} "
                f"of them", "this peer uses a job key (P2PCOLL_KEY_FILE / key_file=): the "
                "rendezvous holds a different one; or what listens there is not a p2pcoll "
                "rendezvous" if self.secure else
                "what listens there is not a p2pcoll rendezvous")

    def _fail(self, what: str, why: str) -> None:
        raise RendezvousError(f"the handshake with the rendezvous at {self.url} failed "
                              f"({what}): {why}", permanent=True)

    def send(self, request: dict[str, Any]) -> None:
        try:
            self._out.send(msgpack.packb(request), zmq.NOBLOCK)
        except zmq.Again:
            pass  # its queue is full (ZeroMQ holds what is sent before the connection is
            # made, up to the high-water mark): the next re-send tries again

    def close(self, goodbye: dict[str, Any] | None = None) -> None:
        if self._probe is not None:
            self._probe.cancel()  # it closes its connection
        if goodbye is not None and self.connected:  # the join may have got there
            self.send(goodbye)
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=100 if goodbye is not None else 0)


async def rendezvous(
    url: str,
    *,
    endpoints: list[str],
    world_size: int | None,
    rank: int | None,
    timeout: float,
    host_id: str,
    choose: Callable[[str, list[str]], str],
    sockets: SocketFactory | None = None,
    heartbeat: float = 5.0,
    job: str = "",
    elastic: tuple[int, int | None] | None = None,
    order: int | None = None,
    expect: int | None = None,
    check: tuple[str, str | None] | None = None,
) -> Membership:
    """Register ``endpoints`` at the rendezvous and wait for the roster.

    ``check`` is ``(target, relay)`` for a peer that may be unreachable: the rendezvous
    connects back to its first tcp endpoint, and if it cannot, names this peer in the roster
    by ``relay://.../target`` at ``relay`` (``tcp://HOST:PORT``; None: the rendezvous
    host's relay), see docs/relay.md.

    ``choose(host, endpoints)`` picks which of a peer's endpoints this peer will use;
    ``elastic`` is ``(min, max)`` world size for an elastic group (``world_size`` None);
    ``order`` ranks this peer among those without a requested rank (lower first);
    ``expect``: an elastic group may form as soon as that many peers are there.

    Raises:
        RendezvousError: on timeout (saying how many peers arrived and which ranks are
            missing, or that no rendezvous host answered), at once when the server rejects
            this peer or reports a registered peer lost, when the handshake fails (a
            different job key, or one side secured and the other not), when something that
            is not a rendezvous answers, and when a host that had answered is silent for
            ``heartbeat`` seconds ("no rendezvous host at URL").
    Cancellation: leaves nothing behind (the server is told, the socket closed).
    """
    link = _Link(url, sockets or SocketFactory())
    request: dict[str, Any] = {
        "v": WIRE_VERSION, "op": "join", "job": job, "rank": rank, "world_size": world_size,
        "endpoints": endpoints, "host": host_id, "pid": os.getpid(), "token": _token,
        "heartbeat": heartbeat,
        "order": order, "min": elastic[0] if elastic else None,
        **({"expect": expect} if expect is not None and elastic else {}),
        "max": elastic[1] if elastic else None,
        **({"check": True, "target": check[0], "relay": check[1]} if check else {}),
    }
    status: dict[str, Any] | None = None
    start = time.monotonic()
    deadline = start + timeout
    goodbye: dict[str, Any] | None = {"v": WIRE_VERSION, "op": "leave", "job": job}
    warn_at = start + SILENT_WARNING if timeout > SILENT_WARNING else float("inf")
    report_at = start + WAIT_REPORT
    try:
        next_send = 0.0
        while True:
            now = time.monotonic()
            if now >= next_send:
                link.send(request)
                next_send = now + RESEND
            link.events()
            if now >= warn_at:
                warn_at = float("inf")
                if link.answered is None:
                    log.warning("%s; still trying until the join timeout (%.3gs in all)",
                                _silence(url, now - start, link), timeout)
            if now >= report_at:
                report_at = now + WAIT_REPORT
                if status is not None:
                    log.warning(_waiting(url, now - start, timeout, status))
            if link.answered is not None and now - link.answered > heartbeat:
                raise RendezvousError(
                    f"no rendezvous host at {url}: it answered until {now - link.answered:.1f}s"
                    f" ago and then went silent (it was stopped, or lost); "
                    + _progress(status)
                )
            if now >= deadline:
                raise _timed_out(url, timeout, status, link)
            wait = min(next_send, deadline, warn_at, report_at) - now
            if not await link.sock.poll(max(1, int(wait * 1000)), zmq.POLLIN):
                continue
            msg = _reply(await link.sock.recv_multipart(), url, ("status", "error", "roster"))
            link.answered = time.monotonic()
            if msg["op"] == "status":
                status = msg
            elif msg["op"] == "error":
                goodbye = None
                whom = ("cannot form this peer's group" if msg.get("about") == "other"
                        else "rejected this peer")
                raise RendezvousError(
                    f"rendezvous at {url} {whom}: {msg.get('reason')}",
                    permanent=msg.get("permanent", True) is not False)
            else:
                goodbye = None
                return _roster(msg, url, choose)
    finally:
        link.close(goodbye)


def _progress(status: dict[str, Any] | None) -> str:
    if status is None:
        return "no peer had been counted yet"
    missing, count = status.get("missing"), status.get("missing_count")
    more = (f" and {count - len(missing)} more" if isinstance(count, int)
            and isinstance(missing, list) and count > len(missing) else "")
    return (f"{status.get('arrived')} of {status.get('world_size')} peers arrived"
            + (f"; missing ranks {missing}{more}" if missing else ""))


def _waiting(url: str, waited: float, timeout: float, status: dict[str, Any]) -> str:
    """Who the group still waits for, who joined, and what sets how long this peer waits."""
    joined = status.get("joined")
    names = []
    if isinstance(joined, list):
        for peer in joined:
            if isinstance(peer, list) and len(peer) == 3:
                rank, host, pid = peer
                names.append(f"rank {rank} ({host}, pid {pid})" if rank is not None
                             else f"{host} (pid {pid})")
    arrived = status.get("arrived")
    more = (f" and {arrived - len(names)} more" if isinstance(arrived, int)
            and arrived > len(names) else "")
    return (f"still waiting at the rendezvous {url} after {waited:.0f}s: {_progress(status)}"
            + (f"; joined: {', '.join(names)}{more}" if names else "")
            + f". This peer waits {timeout:.3g}s in all for the group to form: the join "
            f"timeout (P2PCOLL_JOIN_TIMEOUT, or join(timeout=)); P2PCOLL_TIMEOUT is the "
            f"deadline of each collective, not of the join")


def _silence(url: str, seconds: float, link: _Link) -> str:
    if not link.connected:
        return (f"no rendezvous host at {url}: nothing has accepted a connection there for "
                f"{seconds:.3g}s (is the address right, and the host up and reachable?)")
    return (f"no answer from the rendezvous at {url} for {seconds:.3g}s: something accepted "
            f"the connection but has not answered")


def _timed_out(url: str, timeout: float, status: dict[str, Any] | None, link: _Link
               ) -> RendezvousError:
    if status is not None:
        from .server import hosted_at  # (what its own server refused, if it hosts one)
        server = hosted_at(parse_url(url)[1])
        refused = server.refusals() if server is not None else ""
        return RendezvousError(f"rendezvous at {url} timed out after {timeout:.3g}s: "
                               + _progress(status) + (f"; {refused}" if refused else "")
                               + " (the join timeout: P2PCOLL_JOIN_TIMEOUT, or join(timeout=))")
    if not link.connected:
        return RendezvousError(
            f"no rendezvous host at {url}: no answer within {timeout:.3g}s, nothing accepted "
            f"a connection (is it up and reachable?)", answered=False,
        )
    return RendezvousError(
        f"rendezvous at {url} timed out after {timeout:.3g}s with no answer from the "
        f"rendezvous host (is it up and reachable?)", answered=False,
    )


async def waiting(url: str, *, job: str = "", sockets: SocketFactory | None = None,
                  timeout: float = 5.0, expect: int | None = None) -> int:
    """How many peers are waiting at the rendezvous for ``job``'s next group.

    ``expect``: the elastic group forming may form as soon as that many peers are there
    (as a join's ``expect``; the lowest said wins): a member that learns, while it joins,
    that another it expected was lost says so.

    Raises:
        RendezvousError: no answer within ``timeout``, or the handshake failed.
    """
    link = _Link(url, sockets or SocketFactory())
    try:
        link.send({"v": WIRE_VERSION, "op": "waiting", "job": job,
                   **({"expect": expect} if expect is not None else {})})
        deadline = time.monotonic() + timeout
        while True:
            link.events()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(f"no rendezvous host at {url}: no answer within "
                                      f"{timeout:g}s")
            if await link.sock.poll(int(min(left, 0.1) * 1000) + 1, zmq.POLLIN):
                msg = _reply(await link.sock.recv_multipart(), url, ("waiting", "error"))
                if msg["op"] == "error":
                    raise RendezvousError(f"rendezvous at {url}: {msg.get('reason')}")
                return int(msg.get("count", 0))
    finally:
        link.close()


__all__ = ["rendezvous", "waiting"]
