"""Rendezvous: how peers find each other and get their ranks (``server``, ``client``,
``url``).

:class:`RendezvousServer` is imported on first use: only the peer that hosts the
rendezvous runs one (with its rules, :mod:`.jobs`), so the others never load it."""

from typing import TYPE_CHECKING

from .client import rendezvous
from .url import advertised_host, parse_url

if TYPE_CHECKING:
    from .server import RendezvousServer

__all__ = ["RendezvousServer", "advertised_host", "parse_url", "rendezvous"]


def __getattr__(name: str) -> object:
    if name != "RendezvousServer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .server import RendezvousServer

    globals()[name] = RendezvousServer  # once: later reads find it without this hook
    return RendezvousServer


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
