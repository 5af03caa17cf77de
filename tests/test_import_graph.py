"""No import circles among p2pcoll's modules (issue 34): each module can be read, and
tested, with only what it imports below it.

What counts as an import, read with :mod:`ast` from the source (nothing is imported):

- every ``import`` and ``from ... import`` of a p2pcoll module, wherever it stands: at the
  top, inside a function (a deferred import is the usual way a circle is hidden, as
  settings and launchers had), and under ``if TYPE_CHECKING:`` (a circle of types is a
  circle all the same: neither module reads without the other; the service's was one);
- ``from pkg import name`` counts as importing the module ``pkg.name`` when there is one,
  else the package ``pkg`` itself (its ``__init__`` runs);
- except the package root ``p2pcoll``, a lazy facade that imports nothing but its errors:
  a name taken from it counts as an import of the module it comes from.
"""

from __future__ import annotations

import ast
import functools
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "p2pcoll"

# Circles still there, each as the edge that closes it: none.
KNOWN: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, name: str, is_package: bool
             ) -> list[tuple[str, list[str]]]:
    """(absolute module, names imported from it) of every import in ``tree``."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names]))
    return found


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` for every module under ``root``."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in paths.items()}
    # Where the root facade takes each of its names from.
    homes: dict[str, str] = {}
    if package in trees:
        for target, names in _imports(trees[package], package, True):
            for imported in names:
                homes.setdefault(imported, target)
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        edges = graph.setdefault(name, set())
        for target, names in _imports(tree, name, paths[name].name == "__init__.py"):
            if target != package and not target.startswith(f"{package}."):
                continue
            rest = []
            for imported in names:
                if f"{target}.{imported}" in paths:
                    edges.add(f"{target}.{imported}")
                elif target == package and homes.get(imported, package) != package:
                    edges.add(homes[imported])
                else:
                    rest.append(imported)
            if rest or not names:
                edges.add(target)
        edges.discard(name)
        edges &= paths.keys()
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules, the first repeated last), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


@functools.cache
def _package_graph() -> dict[str, frozenset[str]]:
    return {k: frozenset(v) for k, v in import_graph(ROOT).items()}


def package_graph() -> dict[str, set[str]]:
    """p2pcoll's import graph, read once per run (a copy each time)."""
    return {k: set(v) for k, v in _package_graph().items()}


def test_no_import_circles() -> None:
    graph = package_graph()
    assert len(graph) > 100 and "p2pcoll.session.calls" in graph
    for importer, imported in KNOWN:
        assert imported in graph[importer], f"{importer} no longer imports {imported}: " \
                                            f"take it out of KNOWN"
        graph[importer].discard(imported)
    found = circle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_circles_issue_34_named_are_gone() -> None:
    graph = package_graph()
    assert "p2pcoll.settings" not in graph["p2pcoll.launchers"]
    assert not graph["p2pcoll.service.metrics"] & {"p2pcoll.service.peer", "p2pcoll.service.http"}
    assert "p2pcoll.service.peer" not in graph["p2pcoll.service.http"]
    assert "p2pcoll.service.peer" not in graph["p2pcoll.service.logs"]
    assert "p2pcoll.session.session" not in graph["p2pcoll.session.calls"]
    assert "p2pcoll.session.session" not in graph["p2pcoll.session.control"]


@pytest.mark.parametrize(("where", "source"), [
    ("top", "from . import b\n"),
    ("function", "def f():\n    from .b import thing\n"),
    ("types", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import T\n"),
])
def test_a_circle_is_found_wherever_its_import_stands(
        tmp_path: Path, where: str, source: str) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(source)
    (package / "b.py").write_text("import pkg.a\n")
    found = circle(import_graph(tmp_path, "pkg"))
    assert found is not None and set(found) == {"pkg.a", "pkg.b"}, (where, found)
