"""Which requests of one client connection a rendezvous handles: a rate bound per
connection that never refuses a client for repeating itself. Pure: the clock is passed in.

A token bucket per connection (its routing identity): ``rate`` requests per second, in
bursts of as many. A request over it that repeats the connection's last admitted one (the
same bytes: a client re-sends its join unchanged until it is answered) is that client's
re-send, held back and delivered with others at once (a host that binds its port late:
ZeroMQ queues them until it connects; a server whose loop stalls): it is not handled (the
answer to the request it repeats stands), only counted, so a client that repeats itself is
never refused, however many of its re-sends arrive together. Any other request over it is
dropped, and the first of them answered with an error naming the bound; the rest are
dropped silently until the bucket refills. Each decision is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["handle", "resend", "over", "over-told"]


@dataclass(eq=False, slots=True)
class _Connection:
    tokens: float
    refilled: float  # when ``tokens`` was last brought up to date
    told: bool = False  # over its rate and told so, until it has a token again
    last: tuple[int, int] = (0, -1)  # the last request admitted: hash and length of its bytes


class Admission:
    """The token buckets of the connections a rendezvous heard from.

    Args:
        rate: requests per second of one connection (and its burst).
        kept: connections remembered at most (the least recently heard from is forgotten).
    """

    def __init__(self, rate: float, kept: int) -> None:
        self.rate = rate
        self.kept = kept
        self._connections: OrderedDict[bytes, _Connection] = OrderedDict()

    def admit(self, identity: bytes, raw: bytes, now: float) -> Verdict:
        """``handle`` the request; or it is a ``resend`` over the rate (not handled, not
        refused); or it is ``over`` the rate, dropped silently, or ``over-told``: dropped,
        and the first since the connection was last admitted (tell it the bound)."""
        conn = self._connection(identity, now)
        request = (hash(raw), len(raw))  # a bytes hash, keyed at random per process
        if conn.tokens >= 1:
            conn.tokens -= 1
            conn.told = False
            conn.last = request
            return "handle"
        if request == conn.last:
            return "resend"
        if conn.told:
            return "over"
        conn.told = True
        return "over-told"

    def _connection(self, identity: bytes, now: float) -> _Connection:
        """The connection's record, its bucket refilled up to ``now``."""
        burst = max(1.0, self.rate)
        conn = self._connections.get(identity)
        if conn is None:
            conn = self._connections[identity] = _Connection(burst, now)
            if len(self._connections) > self.kept:
                self._connections.popitem(last=False)
        else:
            self._connections.move_to_end(identity)
            conn.tokens = min(burst, conn.tokens + (now - conn.refilled) * self.rate)
            conn.refilled = now
        return conn
