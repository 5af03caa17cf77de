"""Rendezvous: how peers find each other and get their ranks (``server``, ``client``,
``url``).

:class:`RendezvousServer` is imported on first use: only the peer that hosts the
rendezvous runs one (with its rules, :mod:`.jobs`), so the others never load it."""

from typing import TYPE_CHECKING

from ..lazy import lazy_names

from .client import rendezvous
from .url import advertised_host, parse_url

if TYPE_CHECKING:
    from .server import RendezvousServer

__all__ = ["RendezvousServer", "advertised_host", "parse_url", "rendezvous"]


__getattr__, __dir__ = lazy_names(__name__, globals(), {"RendezvousServer": ".server"})
