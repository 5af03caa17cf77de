"""The MPI side of ``p2pcoll bench --compare mpi``: the same measurement, mpi4py over Open MPI.

Optional (``pip install 'p2pcoll[mpi]'``: the Open MPI wheel brings ``mpirun``). MPI processes
need MPI's own launcher, so the driver (:mod:`p2pcoll.bench.runner`) runs

    mpirun -n N --oversubscribe --bind-to none --mca pml ob1 --mca btl self,tcp \\
        --mca btl_tcp_if_include lo python -m p2pcoll.bench.mpi --out PATH --config JSON

Open MPI's TCP transport on loopback with its default algorithm choice, as
``../shared/ANCHORS.md`` measured it. Each rank measures with
:func:`p2pcoll.bench.measure.measure_blocking`, exactly as the p2pcoll and Gloo workers do, on
the buffer forms of the collectives: ``Allreduce(IN_PLACE, x)``, ``Bcast`` and ``Reduce``
from/to rank 0 (in place on the root), ``Allgather`` into one preallocated array,
``Reduce_scatter`` with the parts of ``numpy.array_split``, summing; the pipelined figure uses
their nonblocking forms (``Iallreduce`` ...). Rank 0 writes the raw rows (strategy ``"mpi"``)
as JSON to PATH.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .measure import (
    ROOT,
    blocking_result,
    fill_value,
    measure_blocking,
    worker_options,
    write_rows,
)


class _Collective:
    """One MPI collective on buffers of its own (a :class:`.measure.BlockingCollective`)."""

    def __init__(self, mpi: Any, comm: Any, collective: str, count: int, dtype: str) -> None:
        self._mpi, self._comm, self._collective = mpi, comm, collective
        self._rank, self._p = comm.Get_rank(), comm.Get_size()
        self._value = fill_value(self._rank)
        self.x = np.full(count, self._value, dtype=dtype)
        self._output: np.ndarray | None = None
        self._counts: list[int] = []
        if collective == "allgather":
            self._output = np.empty(self._p * count, dtype=dtype)
        elif collective == "reduce_scatter":
            self._counts = [len(part) for part in np.array_split(self.x, self._p)]
            self._output = np.empty(self._counts[self._rank], dtype=dtype)
        elif collective == "alltoall":  # part j (numpy.array_split) to rank j
            self._counts = [len(part) for part in np.array_split(self.x, self._p)]
            self._output = np.empty(self._counts[self._rank] * self._p, dtype=dtype)

    def refill(self) -> None:
        self.x.fill(self._value)

    def start(self, wait: bool = True) -> Any:
        c, comm, x, in_place = self._collective, self._comm, self.x, self._mpi.IN_PLACE
        if c == "allreduce":
            return comm.Allreduce(in_place, x) if wait else comm.Iallreduce(in_place, x)
        if c == "broadcast":
            return comm.Bcast(x, root=ROOT) if wait else comm.Ibcast(x, root=ROOT)
        if c == "reduce":
            send, recv = (in_place, x) if self._rank == ROOT else (x, None)
            return (comm.Reduce(send, recv, root=ROOT) if wait
                    else comm.Ireduce(send, recv, root=ROOT))
        if c == "allgather":
            return comm.Allgather(x, self._output) if wait else comm.Iallgather(x, self._output)
        if c == "alltoall":
            sends: list[Any] = [x, self._counts]
            recvs: list[Any] = [self._output, [self._counts[self._rank]] * self._p]
            return comm.Alltoallv(sends, recvs) if wait else comm.Ialltoallv(sends, recvs)
        if c == "reduce_scatter":
            if wait:
                return comm.Reduce_scatter(x, self._output, recvcounts=self._counts)
            return comm.Ireduce_scatter(x, self._output, recvcounts=self._counts)
        raise ValueError(f"unknown collective {c!r}")

    def result(self) -> Any:
        return blocking_result(self._collective, self._rank, self._p, self.x, self._output)


def main(argv: Sequence[str] | None = None) -> int:
    out, config = worker_options(
        "python -m p2pcoll.bench.mpi",
        "MPI worker of `p2pcoll bench --compare mpi` (started by mpirun).",
        argv,
    )

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != config["world_size"]:
        raise SystemExit(f"{comm.Get_size()} MPI ranks, but the configuration says "
                         f"{config['world_size']}")

    def slowest(values: list[float]) -> list[float]:
        if not values:
            return []
        mine = np.array(values, dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        return [float(v) for v in mine]

    rows = [
        measure_blocking(
            config, nbytes, comm.Get_rank(), comm.Get_size(), "mpi",
            lambda count: _Collective(MPI, comm, config["collective"], count, config["dtype"]),
            comm.Barrier, slowest,
        )
        for nbytes in config["sizes"]
    ]
    if comm.Get_rank() == 0:
        write_rows(out, rows)
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
