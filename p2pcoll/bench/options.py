"""The command line of ``p2pcoll bench``: its options, their checks, and the configuration
every worker gets (:func:`bench_config`).

Bad values are argparse errors (exit code 2, before any peer starts), including a bad
``$P2PCOLL_TRANSPORT`` when it stands in for ``--transport``. A missing optional dependency
is reported by :func:`missing_extras`, naming what to install. What the whole command cannot
do is found by :func:`check_cost_model` (a bad ``$P2PCOLL_COST_MODEL``, which the peers would
fail to join with) and, for ``--calibrate``, :func:`calibration_target` (where the cost model
is written, what it measures, and options it decides itself).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.costs import TRANSPORTS, load_constants
from ..extras import install_command, installed
from ..registry import available_strategies
from ..settings import TRANSPORT_NAMES, bad_value, check_path, parse_bytes
from ..types import check_dtype
from .runner import mpirun

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")
DEFAULT_SIZES = "4K,64K,1M,16M"
CALIBRATE_SIZES = "4K,16K,64K,256K,1M,4M,16M"  # small ones give alpha, large ones beta
TRANSPORT_VARIABLE = "P2PCOLL_TRANSPORT"  # the default of --transport
COST_MODEL_VARIABLE = "P2PCOLL_COST_MODEL"  # auto's constants; where --calibrate writes them
COST_MODEL_FILE = "p2pcoll-cost-model.json"  # ... when neither --cost-model nor it is given

BENCH_EXTRA = install_command("bench")
MPI_INSTALL = install_command("mpi")
PEERS = {  # --compare NAME: (what its worker needs: (module or program, how to install it))
    "gloo": (("torch", BENCH_EXTRA),),
    "mpi": (("mpi4py", MPI_INSTALL), ("mpirun", MPI_INSTALL)),
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``p2pcoll bench`` to ``parser``."""
    parser.add_argument("--collective", choices=COLLECTIVES, default="allreduce",
                        help="the collective to time (default: allreduce)")
    parser.add_argument("--strategy", default="auto", metavar="NAME|all|auto",
                        help="a strategy name (or several, comma-separated), 'all' (every "
                             "installed strategy of the collective, one table block each) or "
                             "'auto' (default: the library's own choice per size)")
    parser.add_argument("-n", "--world-size", type=_positive, default=2, metavar="N",
                        help="number of peer processes (default: 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=None, metavar="LIST",
                        help="bytes of each rank's tensor, comma-separated, K/M/G = 2^10/2^20/"
                             f"2^30 (default: {DEFAULT_SIZES}; with --calibrate "
                             f"{CALIBRATE_SIZES}); for allgather, each rank's part")
    parser.add_argument("--dtype", type=_dtype, default="float32",
                        help="element type (default: float32)")
    parser.add_argument("--iters", type=_positive, default=20,
                        help="timed iterations per size (default: 20)")
    parser.add_argument("--warmup", type=_non_negative, default=3,
                        help="untimed iterations per size before timing (default: 3)")
    parser.add_argument("--pipelined", type=_non_negative, default=4, metavar="K",
                        help="collectives issued together for the pipelined figure "
                             "(default: 4; 0 skips it)")
    parser.add_argument("--transport", choices=TRANSPORT_NAMES, type=_transport,
                        default=_FromEnvironment.read(TRANSPORT_VARIABLE, "auto"),
                        help="between the peer processes: auto (ipc on one host), tcp or ipc "
                             f"(default: ${TRANSPORT_VARIABLE}, else auto); inproc runs the "
                             "peers as tasks in this process")
    parser.add_argument("--insecure", dest="secure", action="store_false",
                        help="plain sockets between the p2pcoll peers; by default they run "
                             "CurveZMQ with an ephemeral job key, as `p2pcoll launch` does "
                             "(run both to see the cost of encryption)")
    parser.add_argument("--compare", choices=tuple(PEERS), action="append", default=[],
                        metavar="|".join(PEERS),
                        help="after p2pcoll, time the same collective, sizes and world size "
                             "with torch.distributed's Gloo backend (processes started the same "
                             "way) or mpi4py over Open MPI's TCP transport (started by mpirun) and "
                             f"print the ratios per row; gloo needs {BENCH_EXTRA}, mpi needs "
                             f"{MPI_INSTALL}; may be given twice")
    parser.add_argument("--load", type=_non_negative, default=0, metavar="N",
                        help="start N CPU-bound processes before the first peer and stop "
                             "them after the last (a busy host: every library runs beside "
                             "them; default: 0)")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="draw busbw and time against size as a PNG at PATH, one line per "
                             f"strategy and compared library; needs matplotlib ({BENCH_EXTRA})")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as JSON to PATH ('-' for stdout, no table)")
    parser.add_argument("--calibrate", action="store_true",
                        help="instead of the table: measure this host's cost-model constants "
                             "(alpha, beta, gamma and the host term's overhead) for the ipc "
                             "and tcp transports (--transport ipc or tcp: only that one) with "
                             "2 and 4 peers at --sizes, fit them and write the file that auto "
                             "reads (see --cost-model); takes 10-20 s")
    parser.add_argument("--cost-model", metavar="PATH", default=None,
                        help="with --calibrate: the JSON file to write (default: "
                             f"${COST_MODEL_VARIABLE}, else ./{COST_MODEL_FILE}); the "
                             "transports not measured keep what the file had")


# --- checks of single values ----------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of byte counts, e.g. ``"4K,64K,1M"`` (see
    :func:`p2pcoll.settings.parse_bytes`)."""
    try:
        sizes = [parse_bytes(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def _dtype(text: str) -> str:
    try:
        return check_dtype(np.dtype(text)).name
    except TypeError as exc:  # a dtype p2pcoll does not send
        raise argparse.ArgumentTypeError(str(exc)) from None
    except Exception:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}") from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text}")
    return value


class _FromEnvironment(str):
    """An option's default read from an environment variable, which its check names.

    argparse passes a string default through the option's ``type`` when the option is not
    given, but does not check it against ``choices``: :func:`_transport` does that.
    """

    variable: str

    @classmethod
    def read(cls, variable: str, fallback: str) -> str:
        """``$variable`` (stripped, as :mod:`p2pcoll.settings` reads it), else ``fallback``."""
        value = os.environ.get(variable, "").strip()
        if not value:
            return fallback
        default = cls(value)
        default.variable = variable
        return default


def _transport(text: str) -> str:
    # A value given on the command line is checked against `choices` by argparse.
    if isinstance(text, _FromEnvironment) and text not in TRANSPORT_NAMES:
        allowed = "one of " + ", ".join(TRANSPORT_NAMES)
        raise argparse.ArgumentTypeError(str(bad_value(f"${text.variable}", text, allowed)))
    return str(text)


# --- checks of the whole command ------------------------------------------------------------


def resolve_strategies(collective: str, requested: str) -> list[str]:
    """The strategy names to run: ``all`` expands, unknown names raise ``ValueError``."""
    installed = available_strategies()[collective]
    if requested == "all":
        return installed
    names = [name.strip() for name in requested.split(",") if name.strip()]
    for name in names:
        if name != "auto" and name not in installed:
            raise ValueError(
                f"no {collective} strategy named {name!r}; available: "
                + ", ".join(["auto", "all", *installed])
            )
    return names or ["auto"]


def missing_extras(args: argparse.Namespace) -> str | None:
    """Why the options cannot run here (an optional dependency is absent), or None."""
    needs = [(f"--compare {peer}", what, install) for peer in args.compare
             for what, install in PEERS[peer]]
    if args.plot is not None:
        needs.append(("--plot", "matplotlib", BENCH_EXTRA))
    for option, what, install in needs:
        found = mpirun() is not None if what == "mpirun" else installed(what)
        if not found:
            return f"{option} needs {what}, which is not installed: {install}"
    return None


def check_cost_model(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Refuse what would fail only once the peers run: a ``$P2PCOLL_COST_MODEL`` that is
    not a cost model (every peer's ``join()`` would raise), and ``--cost-model`` without
    ``--calibrate``. With ``--calibrate`` see :func:`calibration_target` instead.

    Raises:
        SettingsError, ValueError: naming the variable or option and the problem.
    """
    if args.calibrate:
        return
    if args.cost_model is not None:
        raise ValueError(f"--cost-model names the file --calibrate writes; the peers of a "
                         f"benchmark read theirs from ${COST_MODEL_VARIABLE}")
    path = (os.environ if environ is None else environ).get(COST_MODEL_VARIABLE, "").strip()
    if path:
        load_constants(path, f"${COST_MODEL_VARIABLE}")


# Options whose meaning --calibrate fixes itself: (dest, the option, why).
CALIBRATE_DECIDES = (
    ("collective", "--collective", "it times allreduce"),
    ("strategy", "--strategy", "it picks strategies whose costs tell the constants apart"),
    ("world_size", "-n/--world-size", "it runs 2 peers, and 4 for the host term"),
    ("pipelined", "--pipelined", "it times one collective at a time"),
    ("compare", "--compare", "it measures p2pcoll's peers only"),
    ("load", "--load", "it measures the host as it is"),
    ("plot", "--plot", "it draws nothing"),
    ("json", "--json", "it writes the cost model, to --cost-model"),
)


def calibration_target(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> tuple[Path, str, tuple[str, ...]]:
    """Where ``--calibrate`` writes, under which name errors call it, and the transports
    it measures (``--transport``: auto means both).

    The file is ``--cost-model``, else ``$P2PCOLL_COST_MODEL``, else ``./p2pcoll-cost-model
    .json``, as an absolute path. Its directory must take a new file; if the file exists,
    it must be a cost model (its other transports are kept; anything else is never
    overwritten).

    Raises:
        SettingsError, ValueError: an option that --calibrate decides itself, the inproc
            transport, or an output path that cannot be written; naming it and the problem.
    """
    defaults = argparse.ArgumentParser()
    configure_parser(defaults)
    for dest, option, why in CALIBRATE_DECIDES:
        if getattr(args, dest) != defaults.get_default(dest):
            raise ValueError(f"--calibrate cannot be combined with {option}: {why}")
    if args.transport == "inproc":
        raise ValueError("--calibrate measures peer processes: --transport must be auto "
                         "(ipc and tcp), ipc or tcp, not inproc")
    transports = TRANSPORTS if args.transport == "auto" else (args.transport,)
    env = os.environ if environ is None else environ
    given = env.get(COST_MODEL_VARIABLE, "").strip()
    if args.cost_model is not None:
        text, where = args.cost_model, "--cost-model"
    elif given:
        text, where = given, f"${COST_MODEL_VARIABLE}"
    else:
        text, where = COST_MODEL_FILE, "--cost-model (default)"
    path = Path(check_path(text, where)).absolute()
    if path.is_dir():
        raise ValueError(f"{where}={text!r} is a directory, not a file to write the cost "
                         "model to")
    if path.exists():  # a cost model to update, never some other file to clobber
        load_constants(path, where)
    try:  # os.access says yes to root even on a read-only file system
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise ValueError(f"{where}={text!r}: cannot write to {str(path.parent)!r}: "
                         f"{exc.strerror or exc}") from None
    return path, where, transports


def bench_config(args: argparse.Namespace, strategies: Sequence[str]) -> dict[str, Any]:
    """What every worker is told (as JSON), and the ``config`` of the JSON output."""
    return {
        "collective": args.collective,
        "strategies": list(strategies),
        "world_size": args.world_size,
        "sizes": list(args.sizes or parse_sizes(DEFAULT_SIZES)),
        "dtype": args.dtype,
        "iters": args.iters,
        "warmup": args.warmup,
        "pipelined": args.pipelined,
        "transport": args.transport,
        "secure": getattr(args, "secure", True),
        "compare": list(dict.fromkeys(getattr(args, "compare", None) or [])),
        "load": getattr(args, "load", 0),
    }
