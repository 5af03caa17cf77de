"""``p2pcoll bench``: time one collective between peer processes, nccl-tests style.

Imported only by that command (and ``python -m p2pcoll.bench``), never by ``import p2pcoll``.
The driver starts ``world_size`` p2pcoll peers, then, for ``--compare gloo`` or
``--compare mpi``, as many Gloo or MPI peers; each worker times every size the same way and
its rank 0 writes the raw times to a file; the driver turns them into rows (median, min,
p10-p90 spread and p99, CPU time per call, algbw, busbw, peak RSS) and prints a table, writes
JSON or draws a plot.

One job per module; imports only go down this list:

    driver     main(): options in; peers run; table, JSON or plot out
    options    the command line (configure_parser, parse_sizes) and the workers' configuration
    runner     starts each library's peers (launcher, mpirun, or tasks) and collects their rows
    load       --load N: CPU-bound processes beside every library's peers (a busy host)
    worker     the p2pcoll peer: python -m p2pcoll.bench.worker --out PATH --config JSON
    gloo, mpi  the compared libraries' peers: python -m p2pcoll.bench.gloo / .mpi, the same way
    plot       the PNG of --plot (matplotlib, imported when drawn)
    report     raw rows -> summary rows, ratios and the table; bus_factor, data_bytes
    measure    what the workers share: their command line and output, the expected results,
               peak RSS, and the timing loop of a blocking library (measure_blocking)

Gloo and the plot need the ``bench`` extra (torch, matplotlib); MPI needs
``pip install 'p2pcoll[mpi]'``.
"""

from .driver import main
from .options import configure_parser, parse_sizes
from .report import bus_factor, data_bytes

__all__ = ["bus_factor", "configure_parser", "data_bytes", "main", "parse_sizes"]
