"""Moved to :mod:`p2pcoll.departures.overlay` (the overlay is part of how peers learn of
departures); this name stays while the memory transport still imports it from here."""

from ..departures.overlay import WATCHED, fingers, watched, watchers

__all__ = ["WATCHED", "fingers", "watched", "watchers"]
