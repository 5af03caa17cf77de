"""Starting the peers of each library and collecting the raw rows their rank 0 writes.

Every worker is a module run as ``python -m MODULE --out PATH --config JSON``
(:func:`p2pcoll.bench.measure.worker_options`), started ``world_size`` times:

- p2pcoll (:mod:`p2pcoll.bench.worker`) by :func:`p2pcoll.launch.launch`, with
  ``P2PCOLL_TRANSPORT`` set to ``--transport``. With ``--transport inproc`` the peers cannot
  be processes (an inproc endpoint lives in one process), so they run as tasks in this
  process's event loop instead (and the peak RSS is that of the whole process);
- Gloo (:mod:`p2pcoll.bench.gloo`) by the same launcher, with ``GLOO_SOCKET_IFNAME=lo``;
- MPI (:mod:`p2pcoll.bench.mpi`) by ``mpirun``: Open MPI's TCP transport on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from ..launch import launch
from .measure import read_rows, write_rows

MPI_OPTIONS = ("--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1",
               "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo")


def run(library: str, config: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """Run the peers of ``library`` (p2pcoll, gloo or mpi) on the bench configuration.

    Returns:
        (the exit code of the peers, the raw rows of rank 0; none unless the code is 0).

    Raises:
        FileNotFoundError: ``mpirun`` is not installed (the driver checks that first).
    """
    fd, path = tempfile.mkstemp(prefix="p2pcoll-bench-", suffix=".json")
    os.close(fd)
    try:
        code = _STARTERS[library](config, path)
        return (code, read_rows(path)) if code == 0 else (code, [])
    finally:
        os.unlink(path)


def _command(module: str, config: dict[str, Any], out_path: str) -> list[str]:
    return [sys.executable, "-m", module, "--out", out_path, "--config", json.dumps(config)]


def _p2pcoll(config: dict[str, Any], out_path: str) -> int:
    if config["transport"] == "inproc":
        return asyncio.run(_p2pcoll_inproc(config, out_path))
    return launch(config["world_size"], _command("p2pcoll.bench.worker", config, out_path),
                  prefix_output=False, extra_env={"P2PCOLL_TRANSPORT": config["transport"]},
                  secure=config.get("secure", True))


async def _p2pcoll_inproc(config: dict[str, Any], out_path: str) -> int:
    # Imported here: `python -m p2pcoll.bench.worker` must find it not yet imported.
    from ..testing import run_ranks
    from .worker import run_worker

    results = await run_ranks(config["world_size"], lambda g: run_worker(g, config),
                              transport="inproc")
    write_rows(out_path, results[0])
    return 0


def _gloo(config: dict[str, Any], out_path: str) -> int:
    # Gloo picks its interface by resolving the hostname unless told; the peers are local.
    return launch(config["world_size"], _command("p2pcoll.bench.gloo", config, out_path),
                  prefix_output=False, extra_env={"GLOO_SOCKET_IFNAME": "lo"})


def mpirun() -> str | None:
    """The ``mpirun`` to start Open MPI's peers with: the one beside this Python first (the
    Open MPI wheel's, which mpi4py here was built against, found also when the virtualenv
    is not activated), else the first on ``PATH``; None if there is none. A system Open
    MPI of another version met first on ``PATH`` ran its peers 30-100x slower here."""
    return (shutil.which("mpirun", path=os.path.dirname(sys.executable))
            or shutil.which("mpirun"))


def _mpi(config: dict[str, Any], out_path: str) -> int:
    mpirun_path = mpirun()
    if mpirun_path is None:
        raise FileNotFoundError("mpirun not found: pip install 'p2pcoll[mpi]'")
    command = [mpirun_path, "-n", str(config["world_size"]), *MPI_OPTIONS,
               *_command("p2pcoll.bench.mpi", config, out_path)]
    env = dict(os.environ)
    if os.geteuid() == 0:  # Open MPI refuses to run as root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run(command, env=env, stdin=subprocess.DEVNULL, check=False).returncode


_STARTERS: dict[str, Callable[[dict[str, Any], str], int]] = {
    "p2pcoll": _p2pcoll, "gloo": _gloo, "mpi": _mpi,
}
