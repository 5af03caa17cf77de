"""What a rendezvous's clients and its server agree on besides their messages (drawn in
:mod:`.jobs`), without I/O: how often a client re-sends its join.

Its own module so that a client (:mod:`.client`) reads it without loading the server's
rules (:mod:`.jobs`), which only the peer that hosts the rendezvous needs.
"""

__all__ = ["RESEND"]

RESEND = 0.5  # seconds between a client's re-sent join requests (its heartbeat)
