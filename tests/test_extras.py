"""The extras coexist with what the user has: ranges in pyproject.toml, the exact tested
versions in constraints.txt (which CI exports as PIP_CONSTRAINT), and every extra's range
admitting its tested version."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs]
            for name, reqs in project["optional-dependencies"].items()}


def constraints() -> dict[str, Requirement]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert not req.extras, f"constraints.txt: {line!r} (pip takes no extras there)"
            pins[canonicalize_name(req.name)] = req
    return pins


def test_no_extra_pins_an_exact_version() -> None:
    for extra, reqs in extras().items():
        for req in reqs:
            exact = [s for s in req.specifier if s.operator in ("==", "===")]
            assert not exact, f"extra {extra!r} pins {req} (a range belongs there)"


def test_every_extra_admits_its_tested_version() -> None:
    pins = constraints()
    for extra, reqs in extras().items():
        for req in reqs:
            if canonicalize_name(req.name) == "p2pcoll":
                continue
            pin = pins.get(canonicalize_name(req.name))
            assert pin is not None, f"{req.name} (extra {extra!r}) has no line in constraints.txt"
            (spec,) = pin.specifier
            assert spec.operator == "==", f"constraints.txt: {pin} is not an exact version"
            assert req.specifier.contains(spec.version, prereleases=True), (
                f"extra {extra!r}: {req} excludes the tested {pin}")


def test_dev_pulls_every_other_extra() -> None:
    # `pip install -e '.[dev]'` is all the test suite needs.
    everything = extras()
    (own,) = [r for r in everything["dev"] if canonicalize_name(r.name) == "p2pcoll"]
    assert set(everything) - {"dev", "bench"} <= own.extras
