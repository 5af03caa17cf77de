"""The one entry-point table that strategies and codecs load through
(p2pcoll.plugin_table): validated where they load, broken plugins recorded and named with
their distribution, the same way for both kinds."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest

import p2pcoll
import p2pcoll.codecs.registry as codec_module
import p2pcoll.registry as strategy_module
from p2pcoll.codecs.registry import CodecRegistry
from p2pcoll.plugin_table import PluginTable
from p2pcoll.registry import Registry


@dataclass(frozen=True)
class Dist:
    name: str
    version: str = "2.0"


@dataclass
class FakeEntryPoint:
    name: str
    value: str
    target: Any
    dist: Dist | None = Dist("acme")

    def load(self) -> Any:
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target


def test_strategies_and_codecs_name_a_broken_plugin_alike(
        monkeypatch: pytest.MonkeyPatch) -> None:
    missing = ModuleNotFoundError("No module named 'acme_fast'")
    monkeypatch.setattr(strategy_module, "entry_points", lambda group: [
        FakeEntryPoint("allreduce.fast", "acme_fast:Fast", missing)])
    monkeypatch.setattr(codec_module, "entry_points", lambda group: [
        FakeEntryPoint("int4", "acme_fast:Int4", missing)])
    with pytest.raises(p2pcoll.PluginValidationError) as strategy_error:
        Registry().get("allreduce", "fast")
    with pytest.raises(p2pcoll.PluginValidationError) as codec_error:
        CodecRegistry().get("int4")
    for error, plugin in ((strategy_error, "'allreduce.fast' = 'acme_fast:Fast'"),
                          (codec_error, "'int4' = 'acme_fast:Int4'")):
        assert (f"plugin {plugin} from acme 2.0: failed to import: ModuleNotFoundError: No "
                f"module named 'acme_fast'") in str(error.value)
        assert error.value.__cause__ is missing


class Fruit(str):
    """A str of another class: the same key from it is a clash."""


def table(eps: list[FakeEntryPoint], builtins: tuple[tuple[object, str], ...] = ()
          ) -> PluginTable[str, str]:
    def check(obj: object, where: str) -> str:
        if not isinstance(obj, str):
            raise p2pcoll.PluginValidationError(f"{where}: {obj!r} is not a str")
        if obj == "boom":
            raise RuntimeError("the check itself failed")
        return obj

    return PluginTable(kind="word", scan=lambda: eps, check=check, key=lambda v: v[:1],
                       intended=lambda ep, obj: (None, ep.name), key_of=lambda _, n: n,
                       builtins=lambda: builtins, log=logging.getLogger("test.words"))


def test_validated_where_it_loads_and_recorded_when_broken(
        caplog: pytest.LogCaptureFixture) -> None:
    words = table([FakeEntryPoint("n", "m:N", 3), FakeEntryPoint("b", "m:B", "boom"),
                   FakeEntryPoint("a", "m:A", "apple", Dist("zeta")),
                   FakeEntryPoint("a", "m:A2", Fruit("avocado"), Dist("alpha"))],
                  builtins=(("kiwi", "built-in"),))
    with caplog.at_level(logging.WARNING, logger="test.words"):
        entries = words.entries()
    # alpha before zeta: the same winner of a clash whatever order the scan gives.
    assert {k: (e.value, e.origin) for k, e in entries.items()} == {
        "k": ("kiwi", "built-in"), "a": ("avocado", "alpha 2.0: m:A2")}
    problems = {b.entry_point: str(b) for b in words.broken()}
    assert problems == {
        "n": "plugin 'n' = 'm:N' from acme 2.0: 3 is not a str",
        "b": "plugin 'b' = 'm:B' from acme 2.0: RuntimeError: the check itself failed",
        "a": "plugin 'a' = 'm:A' from zeta 2.0: word 'a' from zeta 2.0: m:A clashes with "
             "the one from alpha 2.0: m:A2",
    }
    assert len(caplog.records) == 3 and all("word plugin" in r.getMessage()
                                            for r in caplog.records)
    assert words.broken_for("n") is not None and words.broken_for("k") is None


def test_added_at_runtime_through_the_same_check() -> None:
    words = table([], builtins=(("kiwi", "built-in"),))
    version = words.version
    assert words.add("lime", "runtime") == "lime" and words.version > version
    words.add("kiwi", "again")  # the same class and key: no clash, the first stays
    assert words.entries()["k"].origin == "built-in"
    with pytest.raises(p2pcoll.PluginValidationError, match="runtime: 5 is not a str"):
        words.add(5, "runtime")
    words.remove("l")
    assert sorted(words.entries()) == ["k"]
