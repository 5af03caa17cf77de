"""A peer lost in the middle of a run, for tests over ``p2pcoll.testing.memory_groups``."""

from __future__ import annotations

from collections.abc import Sequence

import p2pcoll


async def cut_off_and_close(group: p2pcoll.Group) -> None:
    """This rank leaves as a lost peer does: cut off the memory network (nothing it sends
    arrives, nothing more comes to it), then its group closed."""
    group.session.transport.network.cut(group.membership.endpoints[group.rank])
    await group.close()


def assert_survivors_failed(groups: Sequence[p2pcoll.Group],
                            errors: Sequence[object]) -> None:
    """Each survivor's run ended with its group's error (the cause itself, or the
    GroupBroken that refers to it), and the group recorded that cause."""
    for group, exc in zip(groups, errors, strict=True):
        assert isinstance(exc, p2pcoll.P2PCollError), exc
        assert group.cause is not None
        assert exc is group.cause or isinstance(exc, p2pcoll.GroupBroken), exc
