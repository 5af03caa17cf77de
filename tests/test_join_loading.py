"""``join()`` loads the installed strategies while it waits at the rendezvous, not before it
goes there: a newcomer's arrival, which the members it replaces wait for, does not wait for
the scan of the packages' metadata. A strategy chosen by name is still checked before any
socket. The registry and the forming are stand-ins here: the test reads the order of events."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import p2pcoll
from p2pcoll.errors import RendezvousError

join_module = __import__("p2pcoll.api.join", fromlist=["form_group"])

WAIT_S = 5.0  # a bound for a wait that, with the behaviour tested, ends at once


class SlowRegistry:
    """A registry whose load goes on until the forming has started (or WAIT_S passed)."""

    def __init__(self, events: list[str], forming: threading.Event) -> None:
        self.events, self.forming = events, forming
        self.loaded = False

    def load(self) -> None:
        self.events.append("load starts")
        self.forming.wait(WAIT_S)
        self.events.append("load ends")
        self.loaded = True

    def get(self, collective: str, name: str) -> object:
        return object()  # every strategy chosen by name is installed


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], SlowRegistry]:
    events: list[str] = []
    forming = threading.Event()
    registry = SlowRegistry(events, forming)

    async def form(*args: Any, **kwargs: Any) -> Any:
        events.append("forming starts")
        forming.set()
        raise RendezvousError("the stand-in rendezvous forms no group")

    monkeypatch.setattr(join_module, "registry", registry)
    monkeypatch.setattr("p2pcoll.registry.registry", registry)
    monkeypatch.setattr(join_module, "form", form)
    return events, registry


async def test_strategies_load_while_the_peer_goes_to_the_rendezvous(
        stand_ins: tuple[list[str], SlowRegistry]) -> None:
    events, _ = stand_ins
    with pytest.raises(RendezvousError, match="stand-in"):
        await p2pcoll.join("tcp://127.0.0.1:1", min_world_size=2, timeout=5)
    # the forming does not wait for the load (which would wait WAIT_S for the forming);
    # a join that fails leaves the load to its thread
    assert "forming starts" in events
    assert "load ends" not in events[:events.index("forming starts")]


async def test_a_strategy_chosen_by_name_loads_first(
        stand_ins: tuple[list[str], SlowRegistry]) -> None:
    events, registry = stand_ins
    registry.forming.set()  # a load that need not wait for anything
    with pytest.raises(RendezvousError, match="stand-in"):
        await p2pcoll.join("tcp://127.0.0.1:1", min_world_size=2, timeout=5,
                           strategies={"allreduce": "ring"})
    # checked before any socket: the forming waits for the load
    assert events[-1] == "forming starts"
    assert events.index("load ends") < events.index("forming starts")
