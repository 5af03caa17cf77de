"""Rendezvous: how peers find each other and get their ranks (``server``, ``client``,
``url``)."""

from .client import rendezvous
from .server import RendezvousServer
from .url import advertised_host, parse_url

__all__ = ["RendezvousServer", "advertised_host", "parse_url", "rendezvous"]
