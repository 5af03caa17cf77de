"""``torch.distributed.shrink_group`` on a "p2pcoll" process group.

torch 2.13's ``shrink_group`` is Python: it checks the ranks (the ValueErrors and the
RuntimeError it documents), asks the group's backend ``pg._get_backend(device)`` whether it
``supports_shrinking``, calls its ``shrink(ranks, flags, options)``, destroys the old group
(every other group too, when the default one shrinks), and registers the result, as the
new default group if the default one shrank. p2pcoll's process group is its own backend
(:class:`~.backend.ProcessGroupP2PColl`: ``_get_backend`` gives the group itself for CPU)
and its ``shrink`` runs :meth:`p2pcoll.Group.shrink`.

One step cannot take a Python backend: ``_create_shrunk_process_group`` wraps the new
backend in a new C++ ``ProcessGroup`` with ``ProcessGroup._register_backend``, which takes
only a C++ ``Backend``, and torch gives Python no way to make one (``Backend`` has no
Python constructor; a Python backend is a ``ProcessGroup`` subclass, as this one). So
:func:`install` replaces that one function with one that returns a backend that is a
``ProcessGroup`` itself as the new group (named and described as torch names it) and hands
every other backend to torch's own. Everything else is torch's code.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ...api import Group
from ...errors import PeerLost

G = TypeVar("G")
SHRINK_ABORT = 0x01  # torch.distributed.distributed_c10d.SHRINK_ABORT


def install() -> None:
    """Let ``dist.shrink_group`` register a shrunk group that is a Python process group
    (see the module docstring). Idempotent; torch's function is kept for the others."""
    original = c10d._create_shrunk_process_group
    if getattr(original, "p2pcoll", False):
        return

    def create(new_backend: Any, remaining_ranks: list[int], metadata: dict[str, Any],
               is_default_group: bool) -> Any:
        if not isinstance(new_backend, dist.ProcessGroup):  # a C++ Backend: torch's way
            return original(new_backend, remaining_ranks, metadata, is_default_group)
        new_backend._set_group_name(metadata["new_group_name"])
        new_backend._set_group_desc("default:shrunken" if is_default_group
                                    else f"{metadata['original_group_name']}:shrunk")
        if metadata.get("backend_config") is not None:
            c10d._world.pg_backend_config[new_backend] = metadata["backend_config"]
        return new_backend

    create.p2pcoll = True
    c10d._create_shrunk_process_group = create


def backend_for(group: G, device: Any) -> G:
    """``group._get_backend(device)``: the group itself for CPU (its only device).

    Raises:
        RuntimeError: another device, as torch says it.
    """
    kind = torch.device(device).type
    if kind != "cpu":
        raise RuntimeError(f"No backend type associated with device type {kind}")
    return group


def lost_ranks(group: Group) -> list[int]:
    """The ranks of ``group`` known to have gone (lost, or left), and the one named by the
    failure that broke it (a peer's abort may come before the news of the loss it names):
    what the survivors pass to ``dist.shrink_group``."""
    gone = set(group.session.peers.gone())
    if isinstance(group.cause, PeerLost) and group.cause.rank is not None:
        gone.add(group.cause.rank)
    return sorted(gone)


def abort_flag(flags: int) -> bool:
    """Whether ``shrink_flags`` asks to end the old group's calls first (``SHRINK_ABORT``);
    torch has checked them (``SHRINK_DEFAULT`` or ``SHRINK_ABORT``)."""
    return bool(flags & SHRINK_ABORT)


def renumbered(rank: int, size: int, excluded: list[int]) -> tuple[int, int]:
    """This rank's rank and the size in the shrunk group (torch has checked ``excluded``)."""
    gone = set(excluded)
    return rank - sum(1 for r in gone if r < rank), size - len(gone)
