"""Transports move frames between the peers of a group; see :mod:`.base`."""

from .base import Transport, get_transport, host_identity
from .mesh import Mesh

__all__ = ["Mesh", "Transport", "get_transport", "host_identity"]
