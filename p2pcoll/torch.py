"""``import p2pcoll.torch`` registers the ``"p2pcoll"`` torch.distributed backend.

A thin alias of :mod:`p2pcoll.integrations.torch`, where the backend lives.
"""

from __future__ import annotations

from .integrations.torch import (
    NAME,
    Options,
    ProcessGroupP2PColl,
    UnsupportedOperation,
    register,
)

register()

__all__ = ["NAME", "Options", "ProcessGroupP2PColl", "UnsupportedOperation", "register"]

# ``from p2pcoll.torch import hooks`` and ``import p2pcoll.torch.hooks``: the DDP hooks.
import sys as _sys  # noqa: E402

from .integrations.torch import hooks  # noqa: E402

_sys.modules[f"{__name__}.hooks"] = hooks
__all__ += ["hooks"]
