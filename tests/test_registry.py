"""The registry loads every entry point or none, records broken plugins, never falls back.

"auto" picks by the strategies' cost models among the installed ones (see test_cost_model).

Broken plugins are simulated with fake entry points beside the real ones: the registry's
``entry_points`` is monkeypatched, and each test builds its own ``Registry`` so that the
process-wide one is left alone.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import p2pcoll
import p2pcoll.registry as registry_module
from p2pcoll.cli import format_strategies
from p2pcoll.registry import ENTRY_POINT_GROUP, DEFAULTS, BrokenPlugin, Registry
from p2pcoll.strategy import Context, Schedule, Send, Strategy

ROOT = Path(__file__).resolve().parents[1]
REAL_ENTRY_POINTS = registry_module.entry_points


@dataclass(frozen=True)
class FakeDist:
    name: str
    version: str = "1.0"


@dataclass
class FakeEntryPoint:
    """Quacks like ``importlib.metadata.EntryPoint``; ``load`` returns or raises ``target``."""

    name: str
    value: str
    target: Callable[[], object]
    dist: FakeDist | None = FakeDist("acme-strategies")
    group: str = ENTRY_POINT_GROUP
    loads: list[int] = field(default_factory=list)

    def load(self) -> object:
        self.loads.append(1)
        return self.target()


def missing_module() -> object:
    raise ImportError("No module named 'acme_missing'")


class Fancy(Strategy):
    name = "fancy"
    collective = "allreduce"
    description = "a good third-party strategy"

    def schedule(self, ctx: Context) -> Schedule:
        yield from ()


class Unbuildable(Fancy):
    name = "unbuildable"

    def __init__(self) -> None:
        raise RuntimeError("needs a GPU")


def not_a_strategy(ctx: Context) -> Schedule:
    yield Send(0)


def fakes() -> list[FakeEntryPoint]:
    return [
        FakeEntryPoint("allreduce.missing", "acme_missing:Missing", missing_module),
        FakeEntryPoint("broadcast.notclass", "acme:not_a_strategy", lambda: not_a_strategy),
        FakeEntryPoint("allreduce.fancy", "acme:Fancy", lambda: Fancy),
        FakeEntryPoint("allreduce.unbuildable", "acme:Unbuildable", lambda: Unbuildable),
    ]


BROKEN = {  # entry point -> (collective, name, what the problem must say)
    "allreduce.missing": ("allreduce", "missing",
                          r"failed to import: ImportError: No module named 'acme_missing'"),
    "broadcast.notclass": ("broadcast", "notclass",
                           r"not_a_strategy.* is not a p2pcoll\.strategy\.Strategy subclass"),
    "allreduce.unbuildable": ("allreduce", "unbuildable",
                              r"Unbuildable'\(\) raised RuntimeError: needs a GPU"),
}


def real_ones() -> list[Any]:
    return list(REAL_ENTRY_POINTS(group=ENTRY_POINT_GROUP))


def builtins() -> dict[str, list[str]]:
    """{collective: [names]} of the built-ins declared in pyproject.toml."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out: dict[str, list[str]] = {}
    for key in table["project"]["entry-points"][ENTRY_POINT_GROUP]:
        collective, name = key.split(".")
        out.setdefault(collective, []).append(name)
    return out


@pytest.fixture
def with_entry_points(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[Any]], Registry]:
    """``with_entry_points(eps)``: a fresh Registry that will see exactly ``eps``."""

    def make(eps: list[Any]) -> Registry:
        def fake(*, group: str) -> list[Any]:
            assert group == ENTRY_POINT_GROUP
            return list(eps)

        monkeypatch.setattr(registry_module, "entry_points", fake)
        return Registry()

    return make


def test_broken_plugins_do_not_stop_the_others(
    with_entry_points: Callable[[list[Any]], Registry], caplog: pytest.LogCaptureFixture,
) -> None:
    reference = Registry().available()  # the real entry points alone
    eps = fakes()
    reg = with_entry_points([eps[0], eps[1], *real_ones(), eps[2], eps[3]])
    with caplog.at_level(logging.WARNING, logger="p2pcoll.registry"):
        available = reg.available()

    # Every good entry point loaded: the real ones (the built-ins among them) and "fancy".
    expected = {c: sorted([*names, "fancy"] if c == "allreduce" else names)
                for c, names in reference.items()}
    assert available == expected
    for collective, names in builtins().items():
        assert set(names) <= set(available[collective]), collective
    assert type(reg.entries()["allreduce"]["fancy"].strategy) is Fancy

    # The broken ones are recorded, not listed, and each was logged once, by name.
    assert {b.entry_point for b in reg.broken()} == set(BROKEN)
    for plugin in reg.broken():
        collective, name, problem = BROKEN[plugin.entry_point]
        assert (plugin.collective, plugin.name) == (collective, name)
        assert plugin.distribution == "acme-strategies 1.0"
        assert re.search(problem, plugin.problem), plugin.problem
        assert name not in available[collective]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(BROKEN)
    for entry_point in BROKEN:
        [record] = [r for r in warnings if f"plugin {entry_point!r}" in r.getMessage()]
        assert "acme-strategies 1.0" in record.getMessage()
        assert re.search(BROKEN[entry_point][2], record.getMessage())


@pytest.mark.parametrize("entry_point", sorted(BROKEN))
def test_selecting_a_broken_plugin_names_it(
    entry_point: str, with_entry_points: Callable[[list[Any]], Registry],
) -> None:
    reg = with_entry_points([*fakes(), *real_ones()])
    collective, name, problem = BROKEN[entry_point]
    for select in (lambda: reg.get(collective, name),
                   lambda: reg.choose(collective, name, None, 0, 4),
                   lambda: reg.choose(collective, None, name, 0, 4)):
        with pytest.raises(p2pcoll.PluginValidationError) as info:
            select()
        message = str(info.value)
        assert f"{collective} strategy {name!r} cannot be used" in message
        assert f"plugin {entry_point!r}" in message
        assert "acme-strategies 1.0" in message
        assert re.search(problem, message), message
        assert not isinstance(info.value, p2pcoll.UnknownStrategy)
        assert info.value.__cause__ is not None  # the original exception, for the traceback
    # An unknown name is still UnknownStrategy, listing only the good ones.
    with pytest.raises(p2pcoll.UnknownStrategy, match="available: auto, ") as unknown:
        reg.get(collective, "nope")
    assert name not in str(unknown.value)


def test_a_second_load_gives_the_same_result(
    with_entry_points: Callable[[list[Any]], Registry], caplog: pytest.LogCaptureFixture,
) -> None:
    eps = [*fakes(), *real_ones()]
    reg = with_entry_points(eps)
    with caplog.at_level(logging.WARNING, logger="p2pcoll.registry"):
        first = (reg.available(), reg.broken())
        second = (reg.available(), reg.broken())
    assert first == second
    assert all(len(ep.loads) == 1 for ep in eps if isinstance(ep, FakeEntryPoint))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == len(BROKEN)
    # A registry loaded anew from the same entry points (in another order) agrees.
    again = with_entry_points(list(reversed(eps)))
    assert (again.available(), again.broken()) == first


def test_a_failing_scan_leaves_nothing_half_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the scan itself fails part-way the registry stays unloaded; the next use retries
    and loads everything."""
    good = real_ones()
    calls: list[int] = []

    def flaky(*, group: str) -> Iterator[Any]:
        calls.append(1)
        yield from good[:3]
        if len(calls) == 1:
            raise OSError("metadata directory vanished")
        yield from good[3:]

    monkeypatch.setattr(registry_module, "entry_points", flaky)
    reg = Registry()
    with pytest.raises(OSError, match="vanished"):
        reg.available()
    assert sorted(n for names in reg.available().values() for n in names) == sorted(
        ep.name.split(".")[1] for ep in good
    )
    assert reg.broken() == []
    assert len(calls) == 2


def test_auto_chooses_by_the_cost_model_among_what_is_installed(
    with_entry_points: Callable[[list[Any]], Registry],
) -> None:
    # The built-in that the model prefers for large allreduces is not installed: auto
    # takes the best of those that are, and never a strategy without a cost model.
    preferred = DEFAULTS["allreduce"]
    without = [ep for ep in real_ones() if ep.name != f"allreduce.{preferred}"]
    without.append(FakeEntryPoint("allreduce.fancy", "acme:Fancy", lambda: Fancy))
    reg = with_entry_points(without)
    assert reg.auto("allreduce", 0, 2).name == "recursive_doubling"
    large = reg.auto("allreduce", 1 << 30, 8).name
    assert large not in (preferred, "fancy")
    times = reg.predictions("allreduce", 1 << 30, 8)
    assert times["fancy"] is None
    # on one host auto leaves out the strategies that need several (hierarchical)
    eligible = [t for name, t in times.items()
                if t is not None and not reg.get("allreduce", name).needs_hosts]
    assert times[large] == min(eligible)
    assert reg.choose("allreduce", "auto", "auto", 1 << 30, 8).name == large
    assert reg.choose("allreduce", "ring", None, 1 << 30, 8).name == "ring"  # by name: fine


def test_auto_never_falls_back_silently(
    with_entry_points: Callable[[list[Any]], Registry],
) -> None:
    # Nothing installed has a cost model, and the default is not installed: auto says so.
    preferred = DEFAULTS["allreduce"]
    reg = with_entry_points([FakeEntryPoint("allreduce.fancy", "acme:Fancy", lambda: Fancy)])
    with pytest.raises(p2pcoll.UnknownStrategy) as info:
        reg.auto("allreduce", 1 << 30, 8)
    message = str(info.value)
    assert f"auto picks the allreduce strategy {preferred!r}" in message
    assert "not installed" in message and "installed: fancy" in message
    with pytest.raises(p2pcoll.UnknownStrategy, match=preferred):
        reg.choose("allreduce", None, None, 1 << 30, 8)

    # Every broadcast strategy unregistered at runtime: the same.
    reg = with_entry_points(real_ones())
    for name in reg.available()["broadcast"]:
        reg.unregister("broadcast", name)
    with pytest.raises(p2pcoll.UnknownStrategy, match=r"'pipeline' for 0 bytes on 4 peers"):
        reg.auto("broadcast", 0, 4)


def test_auto_names_a_broken_preferred_plugin(
    with_entry_points: Callable[[list[Any]], Registry],
) -> None:
    preferred = DEFAULTS["allreduce"]
    eps = [FakeEntryPoint("allreduce.fancy", "acme:Fancy", lambda: Fancy),
           FakeEntryPoint(f"allreduce.{preferred}", "acme:Gone", missing_module)]
    reg = with_entry_points(eps)
    with pytest.raises(p2pcoll.PluginValidationError) as info:
        reg.auto("allreduce", 1 << 30, 8)
    assert f"auto picks the allreduce strategy {preferred!r}" in str(info.value)
    assert "acme-strategies 1.0" in str(info.value) and "ImportError" in str(info.value)


def test_choose_reads_no_environment(
    with_entry_points: Callable[[list[Any]], Registry], monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = with_entry_points(real_ones())
    monkeypatch.setenv("P2PCOLL_ALLREDUCE", "ring")
    assert reg.choose("allreduce", None, None, 0, 2).name == "recursive_doubling"  # auto
    assert reg.choose("allreduce", None, "ring", 0, 2).name == "ring"  # the group's default
    assert reg.choose("allreduce", "reduce_broadcast", "ring", 0, 2).name == "reduce_broadcast"
    source = Path(registry_module.__file__).read_text()
    assert "os.environ" not in source and "getenv" not in source


def test_clashing_plugins_resolve_the_same_way_whatever_the_scan_order(
    with_entry_points: Callable[[list[Any]], Registry],
) -> None:
    """A third-party plugin cannot displace a built-in, and of two third-party plugins with
    one name the first by distribution name wins; the loser is recorded as broken."""

    class Impostor(Fancy):
        name = "ring"

    class OtherFancy(Fancy):
        pass

    extra = [
        FakeEntryPoint("allreduce.ring", "zeta:Impostor", lambda: Impostor, FakeDist("zeta")),
        FakeEntryPoint("allreduce.fancy", "beta:OtherFancy", lambda: OtherFancy,
                       FakeDist("beta")),
        FakeEntryPoint("allreduce.fancy", "alpha:Fancy", lambda: Fancy, FakeDist("alpha")),
    ]
    for eps in ([*extra, *real_ones()], [*real_ones(), *reversed(extra)]):
        reg = with_entry_points(eps)
        entries = reg.entries()["allreduce"]
        assert type(entries["ring"].strategy).__module__ == "p2pcoll_plugins.ring"
        assert type(entries["fancy"].strategy) is Fancy
        losers = {b.value: b for b in reg.broken()}
        assert set(losers) == {"zeta:Impostor", "beta:OtherFancy"}
        assert "clashes with the one from p2pcoll" in losers["zeta:Impostor"].problem
        assert "clashes with the one from alpha 1.0" in losers["beta:OtherFancy"].problem
        assert reg.get("allreduce", "ring") is entries["ring"].strategy  # the good one


def test_broken_plugin_record() -> None:
    err = ImportError("x")
    plugin = BrokenPlugin("allreduce.x", "m:X", "d 1", "allreduce", "x", "failed", err)
    assert str(plugin) == "plugin 'allreduce.x' = 'm:X' from d 1: failed"
    assert plugin == BrokenPlugin("allreduce.x", "m:X", "d 1", "allreduce", "x", "failed",
                                  ImportError("another instance"))


def test_strategies_command_lists_broken_plugins_last(
    with_entry_points: Callable[[list[Any]], Registry],
) -> None:
    preferred = DEFAULTS["allreduce"]
    eps = [ep for ep in real_ones() if ep.name != f"allreduce.{preferred}"]
    eps += [*fakes(), FakeEntryPoint(f"allreduce.{preferred}", "acme:Gone", missing_module)]
    reg = with_entry_points(eps)
    lines = format_strategies(reg).splitlines()
    start = lines.index(f"broken plugins ({len(BROKEN) + 1}, not available):")
    tail = "\n".join(lines[start:])
    for entry_point, (_, _, problem) in BROKEN.items():
        assert f"  plugin {entry_point!r} = " in tail and "from acme-strategies 1.0" in tail
        assert re.search(problem, tail), problem
    # Nothing but broken plugins after the heading; auto picks among the usable ones.
    assert all(line.startswith("  ") for line in lines[start + 1:])
    header = next(line for line in lines if line.startswith("allreduce (auto: "))
    assert preferred not in header and "for large" in header
    # Without broken plugins there is no such section.
    assert "broken plugins" not in format_strategies(with_entry_points(real_ones()))
