"""The public API: :func:`join` and :class:`Group`."""

from .group import Group
from .join import join

__all__ = ["Group", "join"]
