"""The ``torch.backends`` entry point that registers the ``"p2pcoll"`` backend inside
``import torch``, at no cost until the backend is used.

torch runs :func:`autoload` inside every ``import torch`` of every program in the
environment, most of which never use p2pcoll; so it registers the name ``"p2pcoll"`` with
:func:`create`, which imports the backend (p2pcoll's sockets, event loop and numpy) only
when ``init_process_group("p2pcoll")`` (or ``new_group``) first creates a process group.
Importing this module imports nothing of p2pcoll but its (lazy) package ``__init__``.

It lives outside :mod:`p2pcoll.integrations.torch` because that package imports
``torch.distributed``: when a program's first torch import is ``import p2pcoll.torch``,
torch runs this entry point while that package is still half imported, and an entry point
inside it would fail (and with it ``import torch``).
"""

from __future__ import annotations

import logging
from typing import Any

NAME = "p2pcoll"


def create(opts: Any, pg_options: Any = None) -> Any:
    """torch's creator for the ``"p2pcoll"`` backend (``extended_api=True``): imports the
    backend and hands over to :func:`p2pcoll.integrations.torch.backend.create`.

    Raises:
        whatever that ``create`` raises (a p2pcoll error when the group cannot form).
    """
    from .torch.backend import create as create_backend

    return create_backend(opts, pg_options)


def autoload() -> None:
    """Register the backend's name with the lazy :func:`create` (idempotent); runs inside
    ``import torch``, whose failure would break every torch program here, so it logs
    instead of raising."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or hasattr(dist.Backend, NAME.upper()):
            return  # no distributed in this torch build, or registered already
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logging.getLogger("p2pcoll").warning("could not register the p2pcoll torch "
                                             "backend: %s", exc)
