"""The package's layers: imports only go down the stack, and plugins see only the strategy API.

    base       errors, types, tensors, pytree, strategy, settings, launchers, security (the
               job key), plugin_table (entry points), extras (optional dependencies), settings_env,
               lazy (names a package imports on first use)
    wire       the message format and its one validation point
    transport  moving frames (ZeroMQ mesh, in-memory network, sockets, shared memory);
               departures (who has gone: a sans-IO machine the session and transport feed)
    engine     plans, matching, the executor            rendezvous  server, client, URLs
    session    one membership epoch, forming, failure    registry    strategy plugins, codecs
    api        Group and join
    training   data-parallel training on the api        testing, launch
    service    a peer as a long-lived service (health, metrics)   integrations  torch.distributed
    bench, cli the command line

A module may import from its own layer and from any layer below, never above (imports
under ``if TYPE_CHECKING:`` excepted: they are types, not dependencies).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "p2pcoll"

LAYERS = {
    "errors": 0, "types": 0, "tensors": 0, "pytree": 0, "strategy": 0, "settings": 0,
    "settings_env": 0,
    "security": 0, "launchers": 0, "plugin_table": 0, "extras": 0, "lazy": 0,
    "wire": 1, "relay": 1,
    "transport": 2, "departures": 2,
    "engine": 3, "rendezvous": 3,
    "session": 4, "registry": 4, "codecs": 4,
    "api": 5,
    "training": 6, "testing": 6, "launch": 6, "service": 6, "integrations": 6, "blocking": 6,
    "bench": 7, "cli": 7, "__main__": 7, "__init__": 7, "torch": 7,
}


def _unit(module: str) -> str:
    """The first component below p2pcoll: 'p2pcoll.engine.plan' -> 'engine'."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "__init__"  # the package itself, or a name imported from it


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every p2pcoll import outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(ROOT).with_suffix("")
    here = list(rel.parts)
    package = here[:-1]
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                typing_only.add(id(inner))
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            out += [(node.lineno, n) for n in names if n.startswith("p2pcoll")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("p2pcoll")]
    return out


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_unit_has_a_layer() -> None:
    units = {_unit(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in MODULES}
    assert units <= set(LAYERS), sorted(units - set(LAYERS))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down(path: Path) -> None:
    me = _unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
    for line, module in _imports(path):
        them = _unit(module)
        assert LAYERS[them] <= LAYERS[me], (
            f"{path.relative_to(ROOT)}:{line} ({me}, layer {LAYERS[me]}) imports {module} "
            f"({them}, layer {LAYERS[them]})"
        )


@pytest.mark.parametrize("path", sorted((ROOT / "plugins").glob("*.py")), ids=lambda p: p.name)
def test_plugins_import_only_the_strategy_api(path: Path) -> None:
    for _, module in _imports(path):
        assert module == "p2pcoll.strategy", f"{path.name} imports {module}"
