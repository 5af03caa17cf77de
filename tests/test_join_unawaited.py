"""A Join used as if it were the Group (the ``await`` forgotten) says what to do."""

from __future__ import annotations

import pytest

import p2pcoll


@pytest.mark.parametrize("name", ["rank", "allreduce", "no_such_thing"])
def test_an_unawaited_join_says_to_await_it(name: str) -> None:
    join = p2pcoll.join(world_size=1)
    with pytest.raises(AttributeError) as caught:
        getattr(join, name)
    first = str(caught.value).splitlines()[0]
    assert f"'Join' object has no attribute {name!r}" in first
    assert "await p2pcoll.join(" in first and "p2pcoll.blocking.join()" in first
    assert caught.value.name == name and not hasattr(join, "__no_such_dunder__")
    assert join.settings.world_size == 1  # its own attributes are there


async def test_the_join_still_gives_its_group_once_awaited() -> None:
    join = p2pcoll.join(world_size=1)
    with pytest.raises(AttributeError):
        join.rank  # noqa: B018
    group = await join
    try:
        assert group.rank == 0 and group.world_size == 1
    finally:
        await group.close()
