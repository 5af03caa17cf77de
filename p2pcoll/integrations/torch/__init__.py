"""p2pcoll as a torch.distributed backend: ``init_process_group("p2pcoll")``.

Installing p2pcoll with torch registers the backend through the ``torch.backends`` entry
point (:mod:`p2pcoll.integrations.torch_autoload`, which torch runs at ``import torch``
unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); ``import p2pcoll.torch`` registers it
explicitly.
The backend is for CPU tensors; see :mod:`.backend` for how each torch collective maps
onto p2pcoll's.
"""

from __future__ import annotations

from ...extras import needs

# torch is the torch extra's: without it, importing the backend (``import p2pcoll.torch``
# included) says what to install. Its submodules all import torch, and all load after this.
with needs("p2pcoll's torch.distributed backend (p2pcoll.torch)"):
    import torch.distributed as dist

    from .backend import ProcessGroupP2PColl, create
    from .options import Options
    from .ops import UnsupportedOperation

NAME = "p2pcoll"


def register() -> None:
    """Register the ``"p2pcoll"`` backend for CPU with torch.distributed (idempotent)."""
    if hasattr(dist.Backend, NAME.upper()):
        return
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])


__all__ = ["NAME", "Options", "ProcessGroupP2PColl", "UnsupportedOperation", "create",
           "register"]
