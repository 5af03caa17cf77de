"""Finds strategies: entry points of the group ``p2pcoll.strategies``, validated as they load.

The built-ins in ``p2pcoll_plugins`` are registered through the same entry points as any
third-party package. ``"auto"`` picks a strategy from the data size and the world size.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from importlib.metadata import entry_points

from .errors import PluginValidationError, UnknownStrategy
from .strategy import COLLECTIVES, Strategy

ENTRY_POINT_GROUP = "p2pcoll.strategies"

# "auto" for allreduce, from `p2pcoll bench --strategy all --compare gloo` on the 2-core
# development machine (benchmarks/README.md): up to 1 MiB recursive doubling (lg p full
# swaps) wins, as latency terms dominate; above, Rabenseifner (bandwidth-optimal like the
# ring, but 2 lg p steps instead of 2(p-1)) won at 16 and 64 MiB. With 2 peers Rabenseifner
# is the ring, and above 1 MiB it beat recursive doubling once sends stopped copying through
# fresh buffers: it copies and reduces half the data (one swap of halves, then the reduced
# halves) where recursive doubling snapshots and reduces all of it. MPICH draws the same line
# at 2 KiB; on this machine a message costs ~100-250 us, which moves it up.
# With 3 or 4 peers and small messages, the star (every peer sends to rank 0, which reduces
# and sends the result back: 2 rounds, 2(p-1) messages) beat recursive doubling (2 rounds
# at p = 3 or 4 too, but every peer sends and receives in each: 2p messages or more): at
# p = 4 on 2 cores, 4 KiB took 1.5 ms against 1.6-2.1 ms, 64 KiB 1.6-1.9 ms against
# 1.9-2.2 ms. With more peers the hub's p-1 serial messages outweigh it (not measured here).
# Broadcast likewise: with at most 4 peers the root sending to each directly (1 round,
# p-1 sends) took 1.3 ms at 4 KiB where the binomial tree (2 rounds) took 1.7 ms, and was
# as fast or faster at 1, 16 and 64 MiB (p = 4, shared-memory rings, this machine).
SMALL_ALLREDUCE = 64 << 10
STAR_MAX_PEERS = 4
MEDIUM_ALLREDUCE = 1 << 20
DEFAULTS = {
    "broadcast": "binomial",
    "reduce": "binomial",
    "allreduce": "rabenseifner",
    "allgather": "ring",
    "reduce_scatter": "ring",
    "gather": "root",
    "scatter": "root",
    "barrier": "dissemination",
}


@dataclass(frozen=True)
class Entry:
    strategy: Strategy
    origin: str  # where it came from, for `p2pcoll strategies`


def validate(obj: object, where: str) -> type[Strategy]:
    """Check that ``obj`` is a usable Strategy class, or raise PluginValidationError."""
    if not (inspect.isclass(obj) and issubclass(obj, Strategy)):
        raise PluginValidationError(f"{where}: {obj!r} is not a p2pcoll.strategy.Strategy subclass")
    name = getattr(obj, "name", None)
    collective = getattr(obj, "collective", None)
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise PluginValidationError(f"{where}: {obj.__name__}.name must be an identifier, got {name!r}")
    if collective not in COLLECTIVES:
        raise PluginValidationError(
            f"{where}: {obj.__name__}.collective is {collective!r}; expected one of {COLLECTIVES}"
        )
    if obj.schedule is Strategy.schedule:
        raise PluginValidationError(f"{where}: {obj.__name__} does not define schedule()")
    return obj


class Registry:
    """All strategies known to this process, by collective and name."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {c: {} for c in COLLECTIVES}
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            where = f"plugin {ep.name!r} = {ep.value!r} from {dist}"
            try:
                obj = ep.load()
            except Exception as exc:
                raise PluginValidationError(f"{where} failed to import: {exc!r}") from exc
            self.register(validate(obj, where), origin=f"{dist}: {ep.value}")

    def register(self, cls: type[Strategy], origin: str = "registered at runtime") -> None:
        """Add a strategy class. Raises PluginValidationError on a bad class or a name clash."""
        self._load()
        validate(cls, origin)
        table = self._entries[cls.collective]
        old = table.get(cls.name)
        if old is not None and type(old.strategy) is not cls:
            raise PluginValidationError(
                f"{cls.collective} strategy {cls.name!r} from {origin} clashes with the one "
                f"from {old.origin}"
            )
        table[cls.name] = Entry(cls(), origin)

    def unregister(self, collective: str, name: str) -> None:
        self._entries[collective].pop(name, None)

    def available(self) -> dict[str, list[str]]:
        self._load()
        return {c: sorted(t) for c, t in self._entries.items()}

    def entries(self) -> dict[str, dict[str, Entry]]:
        self._load()
        return self._entries

    def get(self, collective: str, name: str) -> Strategy:
        """The strategy ``name`` for ``collective``; raises UnknownStrategy listing the choices."""
        self._load()
        if collective not in self._entries:
            raise ValueError(f"unknown collective {collective!r}")
        entry = self._entries[collective].get(name)
        if entry is None:
            names = ", ".join(["auto", *sorted(self._entries[collective])])
            raise UnknownStrategy(
                f"no {collective} strategy named {name!r}; available: {names}"
            )
        return entry.strategy

    def auto(self, collective: str, nbytes: int, size: int) -> Strategy:
        """The strategy "auto" means for this size of data and of group."""
        self._load()
        name = DEFAULTS[collective]
        if collective == "broadcast" and size <= STAR_MAX_PEERS:
            name = "root"
        elif collective == "allreduce" and 2 < size <= STAR_MAX_PEERS and nbytes <= SMALL_ALLREDUCE:
            name = "reduce_broadcast"
        elif collective == "allreduce" and nbytes <= MEDIUM_ALLREDUCE:
            name = "recursive_doubling"
        table = self._entries[collective]
        if name not in table:  # a built-in was unregistered: fall back to anything
            if not table:
                raise UnknownStrategy(f"no {collective} strategy is installed")
            name = sorted(table)[0]
        return table[name].strategy

    def choose(
        self, collective: str, requested: str | None, group_default: str | None,
        nbytes: int, size: int,
    ) -> Strategy:
        """Resolve a strategy: per call, else per group, else ``$P2PCOLL_<COLLECTIVE>``, else auto."""
        name = requested or group_default or os.environ.get(f"P2PCOLL_{collective.upper()}")
        if not name or name == "auto":
            return self.auto(collective, nbytes, size)
        return self.get(collective, name)


registry = Registry()


def available_strategies() -> dict[str, list[str]]:
    """``{collective: [strategy names]}`` for every installed strategy ("auto" not listed)."""
    return registry.available()


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy class in this process (usable as a class decorator)."""
    registry.register(cls, origin=f"{cls.__module__}.{cls.__qualname__} (runtime)")
    return cls
