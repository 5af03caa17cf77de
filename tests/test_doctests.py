"""The examples in the library's docstrings (``>>>``) hold: every module that has one is
run through :mod:`doctest` (one stale example in ``transport/paths.py`` went unseen)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import p2pcoll

ROOT = Path(p2pcoll.__file__).parent
MODULES = sorted(
    ".".join(("p2pcoll", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(
        ".__init__")
    for path in ROOT.rglob("*.py") if ">>> " in path.read_text(encoding="utf-8"))


def test_some_modules_have_examples() -> None:
    assert "p2pcoll.transport.paths" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_module_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"
