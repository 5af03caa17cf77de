"""Finds strategies: entry points of the group ``p2pcoll.strategies``, validated as they load.

The built-ins in ``p2pcoll_plugins`` are registered through the same entry points as any
third-party package. ``"auto"`` picks a strategy from the data size and the world size.

Loading is all or nothing per entry point, never per registry: the first lookup loads every
entry point into a new table and only then swaps it in, so a registry is either not loaded
yet or loaded completely. An entry point that fails to import or to validate does not stop
the others: it is recorded as a :class:`BrokenPlugin` (name, distribution, problem), logged
once as a WARNING on the ``p2pcoll.registry`` logger, listed by :meth:`Registry.broken` and
at the end of ``p2pcoll strategies``; selecting it by name raises
:class:`~p2pcoll.PluginValidationError` with that problem. Nothing here falls back silently:
when the strategy that ``"auto"`` picks is not installed, ``auto`` raises and says which one
it wanted and what is installed.

The registry reads no environment variable: the group passes the default strategy of each
collective (``join(strategies=...)`` over ``$P2PCOLL_<COLLECTIVE>``, from
:class:`p2pcoll.settings.Settings`) as ``group_default`` to :meth:`Registry.choose`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

from .errors import PluginValidationError, UnknownStrategy
from .strategy import COLLECTIVES, Strategy

log = logging.getLogger("p2pcoll.registry")

ENTRY_POINT_GROUP = "p2pcoll.strategies"
OWN_DISTRIBUTION = "p2pcoll"  # its entry points (the built-ins) load first, so they win clashes

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


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point that could not be used: it failed to import or to validate.

    Attributes:
        entry_point: the entry point's name, ``"<collective>.<strategy name>"`` by convention.
        value: what it points at, ``"module:Class"``.
        distribution: the distribution that declares it, ``"name version"``.
        collective: the collective it was meant for, when the entry point's name or the
            loaded class says so; else None.
        name: the strategy name users would select it by, likewise; else None.
        problem: what went wrong, one line.
        error: the exception raised while importing or validating it.
    """

    entry_point: str
    value: str
    distribution: str
    collective: str | None
    name: str | None
    problem: str
    error: BaseException = field(compare=False, repr=False)

    @property
    def where(self) -> str:
        return f"plugin {self.entry_point!r} = {self.value!r} from {self.distribution}"

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


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


Table = dict[str, dict[str, Entry]]


class Registry:
    """All strategies known to this process, by collective and name.

    The entry points are loaded on first use (any method), all of them, into a table that
    replaces the empty one only once complete. Strategies registered at runtime with
    :meth:`register` are added to the loaded table.
    """

    def __init__(self) -> None:
        self._entries: Table = {c: {} for c in COLLECTIVES}
        self._broken: list[BrokenPlugin] = []
        self._loaded = False
        self._lock = threading.Lock()  # load() may run in a thread (see join)

    # --- loading ---------------------------------------------------------------------

    def _load(self) -> None:
        """Load every entry point, then swap the complete table in. Never half-loads: if
        something unexpected escapes (the metadata scan itself failing), nothing changes
        and the next call tries again."""
        if self._loaded:
            return
        entries: Table = {c: {} for c in COLLECTIVES}
        broken: list[BrokenPlugin] = []
        for ep in _in_load_order(entry_points(group=ENTRY_POINT_GROUP)):
            problem = _load_one(ep, entries)
            if problem is not None:
                broken.append(problem)
        self._entries, self._broken, self._loaded = entries, broken, True
        for plugin in broken:  # once per load, and a registry loads once
            log.warning("strategy %s; it is not available", plugin)

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        """Load the installed strategies now rather than on first use. ``join()`` does it
        (in a thread, so the event loop goes on), so that a group's first collective does
        not pay for the scan of the installed packages' metadata (about 0.1 s here), in
        which time its peers would wait for it. Thread-safe."""
        with self._lock:
            self._load()

    def register(self, cls: type[Strategy], origin: str = "registered at runtime") -> None:
        """Add a strategy class. Raises PluginValidationError on a bad class or a name clash."""
        self._load()
        _add(self._entries, validate(cls, origin), origin)

    def unregister(self, collective: str, name: str) -> None:
        self._load()
        self._entries[collective].pop(name, None)

    # --- what is installed -----------------------------------------------------------

    def available(self) -> dict[str, list[str]]:
        """``{collective: [names]}`` of the usable strategies (broken plugins not listed)."""
        self._load()
        return {c: sorted(t) for c, t in self._entries.items()}

    def entries(self) -> dict[str, dict[str, Entry]]:
        """``{collective: {name: Entry}}`` of the usable strategies."""
        self._load()
        return self._entries

    def broken(self) -> list[BrokenPlugin]:
        """The entry points that failed to import or to validate, in load order."""
        self._load()
        return list(self._broken)

    # --- selection -------------------------------------------------------------------

    def get(self, collective: str, name: str) -> Strategy:
        """The strategy ``name`` for ``collective``.

        Raises:
            ValueError: ``collective`` is not one of :data:`~p2pcoll.strategy.COLLECTIVES`.
            PluginValidationError: the plugin that provides ``name`` is installed but broken;
                the message names it, its distribution and the problem.
            UnknownStrategy: nothing of that name is installed; the message lists the choices.
        """
        self._load()
        if collective not in self._entries:
            raise ValueError(f"unknown collective {collective!r}")
        entry = self._entries[collective].get(name)
        if entry is not None:
            return entry.strategy
        plugin = self._broken_for(collective, name)
        if plugin is not None:
            raise PluginValidationError(
                f"{collective} strategy {name!r} cannot be used: {plugin}"
            ) from plugin.error
        raise UnknownStrategy(
            f"no {collective} strategy named {name!r}; available: {self._names(collective)}"
        )

    def auto(self, collective: str, nbytes: int, size: int) -> Strategy:
        """The strategy "auto" means for ``nbytes`` of data in a group of ``size``.

        Raises:
            ValueError: ``collective`` is not a collective.
            PluginValidationError: the strategy auto picks comes from a broken plugin.
            UnknownStrategy: the strategy auto picks is not installed (it was unregistered,
                or its distribution is missing); the message says which one auto wanted and
                what is installed, to be chosen explicitly.
        """
        self._load()
        if collective not in self._entries:
            raise ValueError(f"unknown collective {collective!r}")
        name = self.auto_name(collective, nbytes, size)
        entry = self._entries[collective].get(name)
        if entry is not None:
            return entry.strategy
        wanted = f"auto picks the {collective} strategy {name!r} for {nbytes} bytes on {size} peers"
        plugin = self._broken_for(collective, name)
        if plugin is not None:
            raise PluginValidationError(f"{wanted}, but it cannot be used: {plugin}") from (
                plugin.error
            )
        installed = ", ".join(sorted(self._entries[collective])) or "none"
        raise UnknownStrategy(
            f"{wanted}, but it is not installed (installed: {installed}); "
            f"choose one by name with strategy=... or join(strategies=...)"
        )

    @staticmethod
    def auto_name(collective: str, nbytes: int, size: int) -> str:
        """The name of the strategy "auto" picks for ``nbytes`` of data in a group of ``size``,
        whether it is installed or not (the rules are in the comment above DEFAULTS)."""
        if collective == "broadcast" and size <= STAR_MAX_PEERS:
            return "root"
        if collective == "allreduce" and 2 < size <= STAR_MAX_PEERS and nbytes <= SMALL_ALLREDUCE:
            return "reduce_broadcast"
        if collective == "allreduce" and nbytes <= MEDIUM_ALLREDUCE:
            return "recursive_doubling"
        return DEFAULTS[collective]

    def choose(
        self, collective: str, requested: str | None, group_default: str | None,
        nbytes: int, size: int,
    ) -> Strategy:
        """Resolve a strategy: the one ``requested`` for this call, else the group's default
        (which the group takes from ``join(strategies=...)`` over ``$P2PCOLL_<COLLECTIVE>``),
        else auto. ``"auto"`` at either level means auto. Raises as :meth:`get` and
        :meth:`auto` do."""
        name = requested or group_default
        if not name or name == "auto":
            return self.auto(collective, nbytes, size)
        return self.get(collective, name)

    def _broken_for(self, collective: str, name: str) -> BrokenPlugin | None:
        for plugin in self._broken:
            if (plugin.collective, plugin.name) == (collective, name):
                return plugin
        return None

    def _names(self, collective: str) -> str:
        return ", ".join(["auto", *sorted(self._entries[collective])])


def _distribution(ep: EntryPoint) -> tuple[str, str]:
    """(normalized name, ``"name version"``) of the distribution declaring ``ep``."""
    dist = ep.dist
    if dist is None:
        return "", "unknown distribution"
    return dist.name.lower().replace("_", "-"), f"{dist.name} {dist.version}"


def _in_load_order(eps: Iterable[EntryPoint]) -> list[EntryPoint]:
    """p2pcoll's own entry points first (a plugin cannot displace a built-in), then the
    others by distribution and name: the same order, and so the same winner of a name
    clash, whatever order the metadata scan found them in."""
    def key(ep: EntryPoint) -> tuple[bool, str, str]:
        dist = _distribution(ep)[0]
        return dist != OWN_DISTRIBUTION, dist, ep.name

    return sorted(eps, key=key)


def _intended(ep: EntryPoint, obj: object = None) -> tuple[str | None, str | None]:
    """The (collective, name) an entry point was meant to provide: from the loaded class
    when its attributes are usable, else from the entry point's ``collective.name``."""
    collective, name = getattr(obj, "collective", None), getattr(obj, "name", None)
    if collective in COLLECTIVES and isinstance(name, str) and name.isidentifier():
        return collective, name
    head, dot, tail = ep.name.partition(".")
    if dot and head in COLLECTIVES and tail.isidentifier():
        return head, tail
    return None, None


def _load_one(ep: EntryPoint, entries: Table) -> BrokenPlugin | None:
    """Import and validate one entry point into ``entries``; what went wrong, if anything."""
    dist = _distribution(ep)[1]
    where = f"plugin {ep.name!r} = {ep.value!r} from {dist}"
    obj: object = None
    try:
        obj = ep.load()
    except Exception as exc:  # any failure of a plugin's import is that plugin's problem
        problem = f"failed to import: {type(exc).__name__}: {exc}"
        error: BaseException = exc
    else:
        try:
            _add(entries, validate(obj, where), f"{dist}: {ep.value}")
            return None
        except PluginValidationError as exc:
            text = str(exc)
            problem = text[len(where) + 2:] if text.startswith(f"{where}: ") else text
            error = exc
        except Exception as exc:  # its constructor failed
            problem = f"{getattr(obj, '__name__', obj)!r}() raised {type(exc).__name__}: {exc}"
            error = exc
    collective, name = _intended(ep, obj)
    return BrokenPlugin(ep.name, ep.value, dist, collective, name, problem, error)


def _add(entries: Table, cls: type[Strategy], origin: str) -> None:
    """Put a validated class in ``entries``; PluginValidationError if the name is taken."""
    table = entries[cls.collective]
    old = table.get(cls.name)
    if old is not None and type(old.strategy) is not cls:
        raise PluginValidationError(
            f"{cls.collective} strategy {cls.name!r} from {origin} clashes with the one "
            f"from {old.origin}"
        )
    table[cls.name] = Entry(cls(), origin)


registry = Registry()


def available_strategies() -> dict[str, list[str]]:
    """``{collective: [strategy names]}`` for every installed strategy ("auto" not listed)."""
    return registry.available()


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy class in this process (usable as a class decorator)."""
    registry.register(cls, origin=f"{cls.__module__}.{cls.__qualname__} (runtime)")
    return cls
