"""The p2pcoll backend's ``pg_options``: the strategy per collective."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .ops import UnsupportedOperation


@dataclass(frozen=True)
class Options:
    """``pg_options`` of ``init_process_group("p2pcoll", pg_options=...)`` and
    ``new_group``: the strategy per collective, over ``$P2PCOLL_<COLLECTIVE>``
    (a plain mapping ``{"allreduce": "ring"}`` is taken as ``strategies`` too)."""

    strategies: Mapping[str, str] = field(default_factory=dict)


def options_from(pg_options: Any) -> Options | None:
    """``pg_options`` as given to torch, as Options (None: none given)."""
    if pg_options is None or isinstance(pg_options, Options):
        return pg_options
    if isinstance(pg_options, Mapping):
        return Options(strategies=dict(pg_options))
    raise UnsupportedOperation(
        f"pg_options for the p2pcoll backend must be p2pcoll.torch.Options or a mapping "
        f"of strategies, got {type(pg_options).__name__}")
