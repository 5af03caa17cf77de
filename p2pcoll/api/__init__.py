"""The public API: :func:`join`, :func:`form_group` and :class:`Group`."""

from .group import Group
from .join import form_group, join

__all__ = ["Group", "form_group", "join"]
