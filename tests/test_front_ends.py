"""The front ends offer the same collectives: p2pcoll.blocking forwards every collective of
p2pcoll.Group with its arguments (plus ``async_op``), and the Ray backend implements every
call of Ray's collective group. The list is Group's own methods, not another list here."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from p2pcoll import Group, blocking

COLLECTIVES = sorted(name for name, fn in inspect.getmembers(Group)
                     if inspect.iscoroutinefunction(fn) and not name.startswith("_")
                     and name not in ("close", "shrink"))


def test_the_collectives_are_the_ones_the_docs_name() -> None:
    assert COLLECTIVES == ["allgather", "allreduce", "alltoall", "barrier", "broadcast",
                           "gather", "recv", "recv_any", "reduce", "reduce_scatter", "scatter",
                           "send"]


@pytest.mark.parametrize("name", COLLECTIVES)
def test_blocking_forwards_each_collective_with_its_arguments(name: str) -> None:
    ours = inspect.signature(getattr(Group, name)).parameters
    theirs = dict(inspect.signature(getattr(blocking.Group, name)).parameters)
    flag = theirs.pop("async_op")
    assert flag.kind is inspect.Parameter.KEYWORD_ONLY and flag.default is False
    assert [(p.name, p.kind, p.default) for p in theirs.values()] == \
        [(p.name, p.kind, p.default) for p in ours.values()]


def test_blocking_shrink_takes_the_async_arguments() -> None:
    ours = inspect.signature(Group.shrink).parameters
    theirs = inspect.signature(blocking.Group.shrink).parameters
    assert [(p.name, p.kind, p.default) for p in theirs.values()] == \
        [(p.name, p.kind, p.default) for p in ours.values()]


@pytest.mark.slow  # importing Ray takes seconds
def test_the_ray_backend_implements_every_call_of_ray() -> None:
    if importlib.util.find_spec("ray") is None:  # pragma: no cover - the ray extra is in dev
        pytest.skip("ray not installed: pip install 'p2pcoll[ray]'")
    from ray.util.collective.collective_group.base_collective_group import BaseGroup

    from p2pcoll.integrations.ray import P2PCollGroup

    calls = {name for name in getattr(BaseGroup, "__abstractmethods__", ())}
    assert {"allreduce", "broadcast", "send", "recv"} <= calls
    assert not calls - set(vars(P2PCollGroup)), "a call of Ray's group p2pcoll lacks"
