"""Dispatch of incoming messages by kind, to the part of the session that handles it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..transport.base import Piece
from ..wire import Header

if TYPE_CHECKING:
    from ..engine.matching import Matcher
    from .failure import FailureModel


class Receiver(Protocol):
    """The parts of a session (a :class:`~.session.Session`) that incoming messages go to,
    named here so that this module does not import the session, which starts it."""

    matcher: Matcher
    failures: FailureModel

    def hello_from(self, rank: int) -> None: ...

    def on_departure_message(self, header: Header) -> None: ...


def dispatch(session: Receiver, header: Header, pieces: list[Piece]) -> None:
    """Hand one validated message to its handler.

    Raises:
        ProtocolError: the message is inconsistent with the session's state (the transport
            then drops and counts it).
    """
    kind = header.kind
    if kind == "data":
        if not session.matcher.put(header, pieces):
            # Every message of a collective is received before it finishes, so a message
            # for a finished collective means the ranks disagreed about it.
            session.failures.on_stray(header)
    elif kind == "abort":
        session.on_departure_message(header)  # passed on, then taken (failures.taken)
    elif kind == "hello":
        session.hello_from(header.src)
    elif kind in ("bye", "farewell", "gone"):
        session.on_departure_message(header)  # see p2pcoll.departures
    elif kind == "why":
        # A peer's deadline passed: answer at once whatever this rank is doing (waiting in
        # that collective, failing it, not there yet), from what its receives wait for.
        session.failures.answer(header)
    elif kind == "waiting":
        session.failures.on_answer(header)
    elif kind == "credit":
        flow = session.matcher.flow  # (see p2pcoll.engine.flow)
        if flow is not None and header.meta is not None:
            flow.on_credit(header.src, header.meta, header.seq)
