"""p2pcoll.blocking.join takes p2pcoll.join's arguments, the one list: the same signature,
the same documentation, and the arguments reach the group (two blocking peers as threads
of this process, over loopback tcp).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np
import pytest
from test_blocking import on_ranks

import p2pcoll
import p2pcoll.transport.route as route_module
from p2pcoll import blocking
from p2pcoll.errors import SettingsError
from p2pcoll.testing import free_port


def test_blocking_join_has_join_s_signature() -> None:
    ours = inspect.signature(blocking.join).parameters
    theirs = inspect.signature(p2pcoll.join).parameters
    assert [(p.name, p.kind, p.default, p.annotation) for p in ours.values()] == [
        (p.name, p.kind, p.default, p.annotation) for p in theirs.values()]
    assert {"host_id", "max_links", "reachable", "relay", "streams"} <= set(ours)
    assert inspect.signature(blocking.join).return_annotation == "Group"


def _args_section(doc: str) -> str:
    doc = inspect.cleandoc(doc)
    start = doc.index("\nArgs:\n")
    return doc[start:doc.index("\n\n", start)]


def test_blocking_join_documents_join_s_arguments() -> None:
    doc = inspect.cleandoc(blocking.join.__doc__ or "")
    args = _args_section(doc)
    assert args == _args_section(p2pcoll.join.__doc__ or "")
    for name in inspect.signature(p2pcoll.join).parameters:
        assert re.search(rf"^    (\w+, )*{name}[,:]", args, re.MULTILINE), name
    assert doc.index(args) < doc.index("\nRaises:\n    SettingsError")  # then its own Raises
    assert "LoopBlocked" in doc[doc.index("\nRaises:\n"):]


def test_a_bad_new_argument_is_refused_by_name() -> None:
    with pytest.raises(SettingsError, match="streams="):
        blocking.join("tcp://127.0.0.1:1", world_size=2, streams=99)


def test_blocking_peers_stripe_with_streams_and_a_link_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """streams=2 opens one stripe beside the link to the other peer (as in test_stripes,
    messages of 1 KiB and more stripe here); max_links and host_id reach the settings."""
    monkeypatch.setattr(route_module, "STRIPE_BYTES", 1024)
    monkeypatch.setenv("P2PCOLL_SEGMENT_BYTES", "16K")
    monkeypatch.setenv("P2PCOLL_PROBE", "0")  # the topology's probe would stripe the link
    monkeypatch.setenv("P2PCOLL_TCP_LANES", "0")  # small messages stripe: not on TCP lanes
    url = f"tcp://127.0.0.1:{free_port()}"
    inputs = [np.arange(50_001, dtype=np.float32) * (r + 1) for r in range(2)]

    def rank(r: int) -> tuple[Any, ...]:
        with blocking.join(url, world_size=2, rank=r, timeout=30, transport="tcp",
                           host_id=f"host-{r}", streams=2, max_links=4) as g:
            out = g.allreduce(inputs[r], strategy="ring")
            s = g.settings
            return out, g.stats()["stripes_opened"], s.streams, s.max_links, s.host_id

    results = on_ranks([lambda r=r: rank(r) for r in range(2)])
    for r, (out, stripes, streams, max_links, host_id) in enumerate(results):
        assert np.array_equal(out, inputs[0] + inputs[1])
        assert stripes == 1
        assert (streams, max_links, host_id) == (2, 4, f"host-{r}")
