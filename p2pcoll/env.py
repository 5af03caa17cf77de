"""Where launchers put the rendezvous address, the world size and the rank.

Read in this order, first hit wins:

- rendezvous: ``P2PCOLL_RENDEZVOUS``, else ``tcp://$MASTER_ADDR:$MASTER_PORT`` (torchrun)
- world size: ``WORLD_SIZE`` (torchrun), ``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``
- rank:       ``RANK`` (torchrun), ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``
- advertised host: ``P2PCOLL_HOST`` (else the interface that routes to the rendezvous host)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import RendezvousError

WORLD_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


def _int_var(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            return int(value)
        except ValueError:
            raise RendezvousError(f"${name}={value!r} is not an integer") from None
    return None


def rendezvous_url(env: Mapping[str, str] | None = None) -> str | None:
    """The rendezvous URL the environment names, or None."""
    env = os.environ if env is None else env
    url = env.get("P2PCOLL_RENDEZVOUS")
    if url:
        return url
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        return f"tcp://{addr}:{port}"
    return None


def world_size(env: Mapping[str, str] | None = None) -> int | None:
    return _int_var(os.environ if env is None else env, WORLD_SIZE_VARS)


def rank(env: Mapping[str, str] | None = None) -> int | None:
    return _int_var(os.environ if env is None else env, RANK_VARS)
