"""One table of plugins loaded from an entry-point group, validated where they load: what the
strategies (:mod:`p2pcoll.registry`) and the codecs (:mod:`p2pcoll.codecs.registry`) share.

A table is told how to scan its entry points, how to check what one loads (a function
that returns the usable value, a strategy or a codec instance, or raises
:class:`~p2pcoll.PluginValidationError`), and the key each value is found by. On first use
it loads its built-ins, then every entry point, p2pcoll's own first (a third-party plugin
cannot displace a built-in) and the others by distribution and name (so a clash between
two has the same winner whatever order the metadata scan found them in). Loading is all or
nothing: the new entries are swapped in only once complete, so a table is either not
loaded yet or loaded completely, and a scan that fails part-way leaves nothing behind.

An entry point that fails to import or to validate does not stop the others: it is
recorded as a :class:`BrokenPlugin` (entry point, distribution, problem), logged once as a
WARNING, and asking for its key raises PluginValidationError naming the plugin, its
distribution and the problem. Errors name the plugin as ``plugin 'NAME' = 'module:Attr'
from DISTRIBUTION VERSION``.
"""

from __future__ import annotations

import email.parser
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from typing import Any, Generic, TypeVar

from .errors import PluginValidationError

OWN_DISTRIBUTION = "p2pcoll"  # its entry points (the built-ins) load first, so they win clashes

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class Entry(Generic[V]):
    """A usable plugin: the value its check gave, and where it came from (``"p2pcoll
    0.11.0: p2pcoll_plugins.ring:RingAllreduce"``, for ``p2pcoll strategies``)."""

    value: V
    origin: str


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point that could not be used: it failed to import or to validate.

    Attributes:
        entry_point: the entry point's name (``"<collective>.<strategy name>"`` for a
            strategy, by convention; the codec's name for a codec).
        value: what it points at, ``"module:Class"``.
        distribution: the distribution that declares it, ``"name version"``.
        collective: the collective a strategy was meant for, when its entry point's name or
            the loaded class says so; else (and for a codec) None.
        name: the name users would select it by, likewise; else None.
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


class PluginTable(Generic[K, V]):
    """The plugins of one entry-point group, by key; loaded on first use, thread-safe.

    Args:
        kind: what a plugin is, for messages and the log (``"strategy"``, ``"codec"``).
        scan: the group's entry points (``lambda: entry_points(group=...)``).
        check: ``check(obj, where)``: the usable value of a loaded object, or raises
            PluginValidationError (any other exception counts as that plugin's problem
            too); ``where`` names the plugin for its messages.
        key: the key of a checked value.
        intended: ``intended(entry_point, loaded object or None)``: the (collective, name)
            a broken entry point was meant to provide, as far as can be told; its key is
            made from them by ``key_of``.
        key_of: the key of an intended (collective, name), or None when it has none.
        builtins: ``(object, origin)`` pairs checked and added before any entry point.
        log: where a broken plugin is reported, once per load.
    """

    def __init__(self, *, kind: str, scan: Callable[[], Iterable[EntryPoint]],
                 check: Callable[[object, str], V], key: Callable[[V], K],
                 intended: Callable[[EntryPoint, object], tuple[str | None, str | None]],
                 key_of: Callable[[str | None, str | None], K | None],
                 builtins: Callable[[], Iterable[tuple[object, str]]] = tuple,
                 log: logging.Logger) -> None:
        self.kind = kind
        self._scan, self._check, self._key = scan, check, key
        self._intended, self._key_of, self._builtins, self._log = intended, key_of, builtins, log
        self._entries: dict[K, Entry[V]] = {}
        self._broken: list[BrokenPlugin] = []
        self._loaded = False
        self._lock = threading.RLock()  # load() may run in a thread (see join)
        self.version = 0  # changes whenever the entries do, for caches derived from them

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        """Load the built-ins and every entry point (once; later calls return at once).

        Raises:
            whatever the scan of the metadata raises; nothing is loaded then, and the next
            call tries again. A plugin's own failure is recorded, never raised.
        """
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            entries: dict[K, Entry[V]] = {}
            broken: list[BrokenPlugin] = []
            for obj, origin in self._builtins():
                self._put(entries, self._check(obj, origin), origin)
            for ep in _in_load_order(self._scan()):
                problem = self._load_one(ep, entries)
                if problem is not None:
                    broken.append(problem)
            self._entries, self._broken, self._loaded = entries, broken, True
            self.version += 1
            for plugin in broken:
                self._log.warning("%s %s; it is not available", self.kind, plugin)

    def entries(self) -> dict[K, Entry[V]]:
        """``{key: Entry}`` of the usable plugins (the table's own dict: do not change it)."""
        self.load()
        return self._entries

    def broken(self) -> list[BrokenPlugin]:
        """The entry points that failed to import or to validate, in load order."""
        self.load()
        return list(self._broken)

    def broken_for(self, key: K) -> BrokenPlugin | None:
        """The broken entry point that was meant to provide ``key``, if any."""
        self.load()
        for plugin in self._broken:
            if self._key_of(plugin.collective, plugin.name) == key:
                return plugin
        return None

    def add(self, obj: object, origin: str) -> V:
        """Check ``obj`` and add it; returns its value.

        Raises:
            PluginValidationError: it is not usable, or its key is taken by another class.
        """
        self.load()
        with self._lock:
            value = self._check(obj, origin)
            self._put(self._entries, value, origin)
            self.version += 1
            return value

    def remove(self, key: K) -> None:
        self.load()
        with self._lock:
            self._entries.pop(key, None)
            self.version += 1

    def _put(self, entries: dict[K, Entry[V]], value: V, origin: str) -> None:
        """Add a checked value; the same class again is no clash (the first stays)."""
        key = self._key(value)
        old = entries.get(key)
        if old is None:
            entries[key] = Entry(value, origin)
        elif type(old.value) is not type(value):
            raise PluginValidationError(f"{_describe(self.kind, key)} from {origin} clashes "
                                        f"with the one from {old.origin}")

    def _load_one(self, ep: EntryPoint, entries: dict[K, Entry[V]]) -> BrokenPlugin | None:
        """Import and check one entry point into ``entries``; what went wrong, if anything."""
        dist = distribution(ep)[1]
        where = f"plugin {ep.name!r} = {ep.value!r} from {dist}"
        obj: object = None
        error: BaseException
        try:
            obj = ep.load()
        except Exception as exc:  # any failure of a plugin's import is that plugin's problem
            problem, error = f"failed to import: {type(exc).__name__}: {exc}", exc
        else:
            try:
                self._put(entries, self._check(obj, where), f"{dist}: {ep.value}")
                return None
            except PluginValidationError as exc:
                text = str(exc)
                problem = text[len(where) + 2:] if text.startswith(f"{where}: ") else text
                error = exc
            except Exception as exc:  # a check that did not expect what the plugin does
                problem, error = f"{type(exc).__name__}: {exc}", exc
        collective, name = self._intended(ep, obj)
        return BrokenPlugin(ep.name, ep.value, dist, collective, name, problem, error)


def named_class(obj: object, base: type, base_name: str, example: str, where: str) -> type:
    """``obj`` if it is a concrete subclass of ``base`` (called ``base_name`` in the error)
    whose ``name`` reads like ``example`` (an identifier, dashes allowed); else a
    PluginValidationError naming ``where``. What every kind of class plugin is checked for
    first; each kind then checks what it needs of its own."""
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise PluginValidationError(f"{where}: {obj!r} is not a {base_name} subclass")
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name.replace("-", "_").isidentifier():
        raise PluginValidationError(f"{where}: {obj.__name__}.name must be a name like "
                                    f"{example!r}, got {name!r}")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise PluginValidationError(f"{where}: {obj.__name__} does not define {missing}")
    return obj


def distribution(ep: EntryPoint) -> tuple[str, str]:
    """(normalized name, ``"name version"``) of the distribution declaring ``ep``."""
    dist = ep.dist
    if dist is None:
        return "", "unknown distribution"
    name, version = _name_and_version(dist)
    return name.lower().replace("_", "-"), f"{name} {version}"


def _name_and_version(dist: Any) -> tuple[str, str]:
    """``dist``'s name and version, read from its metadata's headers alone. Its ``name`` and
    ``version`` properties parse the whole file each time, the long description with it
    (p2pcoll's README): 156 parses for p2pcoll's 26 entry points, which made a newcomer's
    join wait 0.1-0.5 s on a host at load 18 and seconds on a busier one."""
    read = getattr(dist, "read_text", None)
    text = (read("METADATA") or read("PKG-INFO")) if read is not None else None
    found = _headers(text) if text else None
    return found if found is not None else (dist.name, dist.version)


@functools.lru_cache(maxsize=8)
def _headers(metadata: str) -> tuple[str, str] | None:
    """(Name, Version) from a METADATA file's headers (None if either is missing)."""
    head = email.parser.HeaderParser().parsestr(metadata.split("\n\n", 1)[0])
    name, version = head.get("Name"), head.get("Version")
    return (name, version) if name and version else None


def _in_load_order(eps: Iterable[EntryPoint]) -> list[EntryPoint]:
    """p2pcoll's own entry points first, then the others by distribution and name."""
    def order(ep: EntryPoint) -> tuple[bool, str, str]:
        dist = distribution(ep)[0]
        return dist != OWN_DISTRIBUTION, dist, ep.name

    return sorted(eps, key=order)


def _describe(kind: str, key: Any) -> str:
    """``allreduce strategy 'ring'`` for a (collective, name) key, ``codec 'int8'`` else."""
    if isinstance(key, tuple) and len(key) == 2:
        return f"{key[0]} {kind} {key[1]!r}"
    return f"{kind} {key!r}"
