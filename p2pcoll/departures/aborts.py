"""How much an abort says, and the bounded memory of the aborts a peer has seen and passed
on (see :class:`~.machine.Departures`)."""

from __future__ import annotations

from typing import Any

from ..wire.header import OWN, Header

__all__ = ["MAX_ABORTS_KEPT", "level", "remember"]

MAX_ABORTS_KEPT = 1024  # aborts remembered: far more than a failing group sends
_TIMEOUT = "CollectiveTimeout"  # the error class name of a deadline, as aborts carry it


def level(abort: Header) -> int:
    """How much an abort says, for passing it on: 2 for a timeout that found the ranks to
    blame (the peers then name the same ones), else 1."""
    meta = abort.meta or {}
    found = (abort.err is not None and abort.err[0] == _TIMEOUT
             and meta.get("blame", OWN) != OWN)
    return 2 if found else 1


def remember(memory: dict[Any, int], key: Any, value: int) -> None:
    """Keep ``key`` in a bounded memory, forgetting the oldest beyond MAX_ABORTS_KEPT."""
    memory.pop(key, None)
    memory[key] = value
    if len(memory) > MAX_ABORTS_KEPT:
        del memory[next(iter(memory))]
