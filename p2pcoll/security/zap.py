"""The ZAP gate: the one ZeroMQ authentication handler of a context, checking job keys.

libzmq asks the ZAP handler bound in a context (``inproc://zeromq.zap.01``) whether to
accept each CURVE client that connects to a server socket of that context. The gate is
pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator` (a thread of its own, so a peer whose
event loop is busy still answers handshakes) with one credentials callback per job: a
socket of a job carries the job's ZAP domain (:attr:`JobKey.domain`) and a client is let in
only if its public key is the job's. The thread runs while some socket factory of the
context uses a job key (:meth:`Gate.admit` / :meth:`Gate.release`, counted), and stops
with the last.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING, ClassVar

import zmq

from .keys import JobKey

if TYPE_CHECKING:  # imported when the first job key is admitted: a plain job has none
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("p2pcoll.security")


class Gate:
    """The ZAP handler of one ZeroMQ context; see the module docstring."""

    _gates: ClassVar[dict[int, Gate]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        self._keys: dict[str, bytes] = {}  # ZAP domain -> the job's public key (Z85)
        self._users: Counter[str] = Counter()  # ZAP domain -> socket factories using it
        self.refused: Counter[str] = Counter()  # ZAP domain -> clients turned away
        self._auth: ThreadAuthenticator | None = None

    @classmethod
    def admit(cls, context: zmq.Context, key: JobKey) -> Gate:
        """Let the holders of ``key`` in to the server sockets of ``context`` (until the
        matching :meth:`release`; one pair per socket factory); starts the handler thread
        if it is not running.

        Raises:
            zmq.ZMQError: another ZAP handler is bound in this context.
        """
        with cls._lock:
            gate = cls._gates.get(context.underlying)
            if gate is None:
                gate = cls._gates[context.underlying] = cls(context)
            if gate._auth is None:
                from zmq.auth.thread import ThreadAuthenticator
                auth = ThreadAuthenticator(context, log=log)
                auth.start()
                gate._auth = auth
            if gate._users[key.domain] == 0:
                gate._keys[key.domain] = key.public
                gate._auth.configure_curve_callback(key.domain, gate)
            gate._users[key.domain] += 1
            return gate

    def release(self, key: JobKey) -> None:
        """One user of ``key``'s job (a socket factory whose sockets are closed) is done;
        the last user of the context stops the thread."""
        with self._lock:
            self._users[key.domain] -= 1
            if self._users[key.domain] > 0:
                return
            del self._users[key.domain]
            self._keys.pop(key.domain, None)
            if self._auth is not None:
                self._auth.credentials_providers.pop(key.domain, None)
                if not self._users:
                    self._auth.stop()
                    self._auth = None

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by the authenticator (on its thread) for each CURVE client."""
        allowed = self._keys.get(domain) == client_key
        if not allowed:
            self.refused[domain] += 1
            if self.refused[domain] in (1, 10, 100, 1000) or self.refused[domain] % 10000 == 0:
                log.warning("refused %d connection(s) with a key that is not the job's "
                            "(ZAP domain %s)", self.refused[domain], domain)
        return allowed

    @classmethod
    def refusals(cls, context: zmq.Context, key: JobKey) -> int:
        """How many clients the gate has refused for ``key``'s job in ``context``."""
        gate = cls._gates.get(context.underlying)
        return gate.refused[key.domain] if gate is not None else 0
