"""Finds strategies: entry points of the group ``p2pcoll.strategies``, validated as they load.

The built-ins in ``p2pcoll_plugins`` are registered through the same entry points as any
third-party package. ``"auto"`` picks, among the installed strategies of the collective,
the one whose cost model (``Strategy.cost``, see :mod:`p2pcoll.engine.costs`) predicts the
lowest time for the data size and world size, under the constants of the group's links (a
:class:`~p2pcoll.engine.costs.CostModel`; the defaults measured on the development machine
when none is given). A strategy without a cost model is never auto's choice, unless no
installed strategy of its collective has one: then auto takes ``DEFAULTS[collective]``.

Loading, validation where a plugin loads, clashes and broken plugins are those of the one
entry-point table both strategies and codecs use (:mod:`p2pcoll.plugin_table`): the first
lookup loads every entry point, all or nothing; an entry point that fails to import or to
validate does not stop the others: it is recorded as a :class:`BrokenPlugin` (name,
distribution, problem), logged once as a WARNING on the ``p2pcoll.registry`` logger, listed
by :meth:`Registry.broken` and at the end of ``p2pcoll strategies``; selecting it by name
raises :class:`~p2pcoll.PluginValidationError` with that problem. Nothing here falls back
silently: when the strategy that ``"auto"`` picks is not installed, ``auto`` raises and says
which one it wanted and what is installed.

The registry reads no environment variable: the group passes the default strategy of each
collective (``join(strategies=...)`` over ``$P2PCOLL_<COLLECTIVE>``, from
:class:`p2pcoll.settings.Settings`) as ``group_default`` to :meth:`Registry.choose`.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from .engine.costs import CostModel
from .errors import PluginValidationError, SettingsError, UnknownStrategy
from .plugin_table import OWN_DISTRIBUTION, BrokenPlugin, PluginTable
from .strategy import COLLECTIVES, Strategy

log = logging.getLogger("p2pcoll.registry")

ENTRY_POINT_GROUP = "p2pcoll.strategies"
DEFAULT_MODEL = CostModel()  # auto's model when the caller has none: ipc constants

# What "auto" takes when no installed strategy of the collective declares a cost model:
# the ones the model picks for large data on many peers (see p2pcoll.engine.costs).
DEFAULTS = {
    "broadcast": "pipeline",
    "reduce": "binomial",
    "allreduce": "rabenseifner",
    "allgather": "recursive_doubling",
    "reduce_scatter": "ring",
    "gather": "root",
    "scatter": "root",
    "barrier": "dissemination",
    "alltoall": "pairwise",
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
        raise PluginValidationError(
            f"{where}: {obj.__name__}.name must be an identifier, got {name!r}")
    if collective not in COLLECTIVES:
        raise PluginValidationError(
            f"{where}: {obj.__name__}.collective is {collective!r}; expected one of {COLLECTIVES}"
        )
    if obj.schedule is Strategy.schedule:
        raise PluginValidationError(f"{where}: {obj.__name__} does not define schedule()")
    return obj


def _usable(obj: object, where: str) -> Strategy:
    """The strategy of a plugin's class: :func:`validate`, then an instance of it."""
    cls = validate(obj, where)
    try:
        return cls()
    except Exception as exc:
        raise PluginValidationError(f"{where}: {cls.__name__!r}() raised "
                                    f"{type(exc).__name__}: {exc}") from exc


Key = tuple[str, str]  # (collective, name)


def _key(strategy: Strategy) -> Key:
    return strategy.collective, strategy.name


def _key_of(collective: str | None, name: str | None) -> Key | None:
    return None if collective is None or name is None else (collective, name)


class Registry:
    """All strategies known to this process, by collective and name.

    The entry points are loaded on first use (any method), all of them, into a table that
    replaces the empty one only once complete. Strategies registered at runtime with
    :meth:`register` are added to the loaded table.
    """

    def __init__(self) -> None:
        self._table: PluginTable[Key, Strategy] = PluginTable(
            kind="strategy", scan=lambda: entry_points(group=ENTRY_POINT_GROUP),
            check=_usable, key=_key, intended=_intended, key_of=_key_of, log=log)
        self._view: dict[str, dict[str, Entry]] = {c: {} for c in COLLECTIVES}
        self._view_version = -1
        self._picks: dict[tuple[str, int, int, CostModel], str] = {}  # auto's, until a change

    # --- loading ---------------------------------------------------------------------

    def _load(self) -> None:
        """Load every entry point (once), and keep the by-collective view up to date."""
        self._table.load()
        if self._view_version != self._table.version:
            view: dict[str, dict[str, Entry]] = {c: {} for c in COLLECTIVES}
            for (collective, name), entry in self._table.entries().items():
                view[collective][name] = Entry(entry.value, entry.origin)
            self._view, self._view_version = view, self._table.version
            self._picks.clear()

    @property
    def _entries(self) -> dict[str, dict[str, Entry]]:
        self._load()
        return self._view

    @property
    def loaded(self) -> bool:
        return self._table.loaded

    def load(self) -> None:
        """Load the installed strategies now rather than on first use. ``join()`` does it
        (in a thread, so the event loop goes on), so that a group's first collective does
        not pay for the scan of the installed packages' metadata (about 0.1 s here), in
        which time its peers would wait for it. Thread-safe."""
        self._load()

    def register(self, cls: type[Strategy], origin: str = "registered at runtime") -> None:
        """Add a strategy class. Raises PluginValidationError on a bad class or a name clash."""
        self._table.add(cls, origin)
        self._load()

    def unregister(self, collective: str, name: str) -> None:
        self._table.remove((collective, name))
        self._load()

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
        return self._table.broken()

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
            f"no {collective} strategy named {name!r}{self._did_you_mean(collective, name)}; "
            f"available: {self._names(collective)}"
        )

    def auto(
        self, collective: str, nbytes: int, size: int, model: CostModel | None = None
    ) -> Strategy:
        """The strategy "auto" means for ``nbytes`` of data in a group of ``size``: the
        installed one with the lowest time predicted by ``model`` (default: the default
        constants of ipc links and the default segmentation).

        Raises:
            ValueError: ``collective`` is not a collective.
            PluginValidationError: the strategy auto picks comes from a broken plugin.
            UnknownStrategy: no installed strategy of ``collective`` has a cost model and
                ``DEFAULTS[collective]`` is not installed; the message says which one auto
                wanted and what is installed, to be chosen explicitly.
        """
        self._load()
        if collective not in self._entries:
            raise ValueError(f"unknown collective {collective!r}")
        name = self.auto_name(collective, nbytes, size, model)
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

    def auto_name(
        self, collective: str, nbytes: int, size: int, model: CostModel | None = None
    ) -> str:
        """The name of the strategy "auto" picks for ``nbytes`` of data in a group of
        ``size``: the installed strategy with the lowest predicted time (of those that are
        ``automatic``, and, if they ``needs_hosts``, only when the model spans several
        hosts one of which holds several ranks), else (none has a cost model)
        ``DEFAULTS[collective]``, installed or not. Cached per registry state."""
        self._load()
        model = model or DEFAULT_MODEL
        key = (collective, nbytes, size, model)
        name = self._picks.get(key)
        if name is None:
            # Ties go to the built-ins, then by name.
            table = self._entries.get(collective, {})
            order = sorted((e for e in table.values() if e.strategy.automatic
                            and (model.shared_hosts or not e.strategy.needs_hosts)),
                           key=lambda e: (not _builtin(e), e.strategy.name))
            best = model.best((e.strategy for e in order), nbytes, size)
            name = best.name if best is not None else DEFAULTS[collective]
            if len(self._picks) > 4096:
                self._picks.clear()
            self._picks[key] = name
        return name

    def predictions(
        self, collective: str, nbytes: int, size: int, model: CostModel | None = None
    ) -> dict[str, float | None]:
        """``{name: predicted seconds}`` of every installed strategy of ``collective``
        (None: it has no cost model)."""
        self._load()
        model = model or DEFAULT_MODEL
        return {name: model.predict(e.strategy, nbytes, size)
                for name, e in sorted(self._entries[collective].items())}

    def choose(
        self, collective: str, requested: str | None, group_default: str | None,
        nbytes: int, size: int, model: CostModel | None = None,
    ) -> Strategy:
        """Resolve a strategy: the one ``requested`` for this call, else the group's default
        (which the group takes from ``join(strategies=...)`` over ``$P2PCOLL_<COLLECTIVE>``),
        else auto under ``model``. ``"auto"`` at either level means auto. Raises as
        :meth:`get` and :meth:`auto` do."""
        name = requested or group_default
        if not name or name == "auto":
            return self.auto(collective, nbytes, size, model)
        return self.get(collective, name)

    def _broken_for(self, collective: str, name: str) -> BrokenPlugin | None:
        return self._table.broken_for((collective, name))

    def _names(self, collective: str) -> str:
        return ", ".join(["auto", *sorted(self._entries[collective])])

    def _did_you_mean(self, collective: str, name: str) -> str:
        """`` (did you mean 'ring'?)`` for the installed name closest to ``name``, or ''."""
        names = sorted(["auto", *self._entries[collective]])
        close = (difflib.get_close_matches(name, names, n=1)
                 or difflib.get_close_matches(name.lower(), names, n=1))
        return f" (did you mean {close[0]!r}?)" if close else ""


def _builtin(entry: Entry) -> bool:
    return entry.origin.startswith(f"{OWN_DISTRIBUTION} ")


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


registry = Registry()


class UnknownStrategySetting(SettingsError, UnknownStrategy):
    """A strategy chosen by a setting (``$P2PCOLL_<COLLECTIVE>`` or ``strategies=``) that is
    not installed: a bad setting (printed as one line under ``p2pcoll launch``) and an
    UnknownStrategy, as a name in code is."""


def check_chosen(strategies: Mapping[str, str], environ: Mapping[str, str]) -> None:
    """Check that every strategy the settings choose (other than ``auto``) is installed;
    ``environ`` (the process's environment) tells which variable chose one.

    Raises:
        UnknownStrategySetting: one is not; the message names the variable (or the
            ``strategies`` entry) that chose it, and the installed ones.
    """
    for collective, name in strategies.items():
        if name == "auto":
            continue
        try:
            registry.get(collective, name)
        except UnknownStrategy as exc:
            variable = f"P2PCOLL_{collective.upper()}"
            where = (f"${variable}" if environ.get(variable) == name
                     else f"strategies[{collective!r}]")
            raise UnknownStrategySetting(
                f"{where}={name!r} is not allowed: {exc}", name=where, value=name,
                allowed=f"an installed {collective} strategy") from None


def available_strategies() -> dict[str, list[str]]:
    """``{collective: [strategy names]}`` for every installed strategy ("auto" not listed)."""
    return registry.available()


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy class in this process (usable as a class decorator)."""
    registry.register(cls, origin=f"{cls.__module__}.{cls.__qualname__} (runtime)")
    return cls
