"""A plugin's distribution is named from its metadata's headers, read once: not from the
``name`` and ``version`` properties of importlib.metadata, which parse the whole file (the
long description with it) at every call, three times an entry point (a newcomer's join
waited on that)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pcoll.plugin_table import distribution

DESCRIPTION = "A long description, as a README makes it.\n" * 2000


class ParsingDist:
    """A distribution whose ``name``/``version`` count the whole-file parses they stand for."""

    def __init__(self, metadata: str | None) -> None:
        self.metadata, self.parses = metadata, 0

    def read_text(self, filename: str) -> str | None:
        return self.metadata if filename == "METADATA" else None

    @property
    def name(self) -> str:
        self.parses += 1
        return "Acme_Fast"

    @property
    def version(self) -> str:
        self.parses += 1
        return "1.2"


@dataclass
class EntryPoint:
    dist: Any
    name: str = "fast"
    value: str = "acme_fast:Fast"


def named(dist: Any) -> tuple[str, str]:
    """``distribution`` of an entry point of ``dist`` (a stand-in for importlib's)."""
    point: Any = EntryPoint(dist)
    return distribution(point)


def test_the_name_and_version_come_from_the_headers_alone() -> None:
    dist = ParsingDist("Metadata-Version: 2.1\nName: Acme_Fast\nVersion: 1.2\n"
                       "Summary: fast\n\n" + DESCRIPTION)
    assert [named(dist) for _ in range(3)] == [
        ("acme-fast", "Acme_Fast 1.2")] * 3
    assert dist.parses == 0


def test_without_readable_headers_the_properties_answer() -> None:
    for metadata in (None, "", "Summary: no name\n\n" + DESCRIPTION):
        dist = ParsingDist(metadata)
        assert named(dist) == ("acme-fast", "Acme_Fast 1.2")
        assert dist.parses == 2
    assert named(None) == ("", "unknown distribution")
