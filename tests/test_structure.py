"""The structure issue 34 asked for stays: modules small enough to read on their own and a
transport protocol that only moves frames. (Import circles: ``test_import_graph.py``;
layers: ``test_layers.py``.)"""

from __future__ import annotations

import inspect
from pathlib import Path

from p2pcoll.transport.base import Transport

ROOT = Path(__file__).resolve().parents[1] / "p2pcoll"
MAX_LINES = 600
MAX_TRANSPORT_METHODS = 7


def test_no_module_is_over_600_lines() -> None:
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for path in ROOT.rglob("*.py")}
    assert len(sizes) > 100  # the package was found
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_transport_protocol_has_at_most_seven_methods() -> None:
    methods = sorted(name for name, member in vars(Transport).items()
                     if inspect.isfunction(member) and not name.startswith("_"))
    assert "send_many" in methods and "post" in methods  # the protocol was read
    assert len(methods) <= MAX_TRANSPORT_METHODS, methods
