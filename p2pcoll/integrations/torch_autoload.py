"""The ``torch.backends`` entry point that registers the ``"p2pcoll"`` backend inside
``import torch``.

It lives outside :mod:`p2pcoll.integrations.torch` because that package imports
``torch.distributed``: when a program's first torch import is ``import p2pcoll.torch``,
torch runs this entry point while the package is still half imported, and an entry point
inside it would fail (and with it ``import torch``).
"""

from __future__ import annotations

import logging
import sys

PACKAGE = "p2pcoll.integrations.torch"


def autoload() -> None:
    """Register the backend; runs inside ``import torch``, whose failure would break every
    torch program here, so it logs instead of raising."""
    module = sys.modules.get(PACKAGE)
    if module is not None and not hasattr(module, "register"):
        return  # that package is being imported now; p2pcoll.torch registers after it
    try:
        from .torch import register

        register()
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logging.getLogger("p2pcoll").warning("could not register the p2pcoll torch "
                                             "backend: %s", exc)
