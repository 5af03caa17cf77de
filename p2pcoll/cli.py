"""The ``p2pcoll`` command. ``python -m p2pcoll`` is the same program.

    p2pcoll launch -n 4 -- python train.py          N processes on this host, one group
    p2pcoll strategies                               installed strategies and their origin
    p2pcoll rendezvous --host 0.0.0.0 --port 29500   a standalone rendezvous server
    p2pcoll keygen job.key                           a new job key file (mode 0600)
    p2pcoll peer --job train:job --metrics-port 9100 one peer as a service
    p2pcoll bench --collective allreduce -n 4        time a collective (see p2pcoll.bench)
    p2pcoll simulate -n 1024 --size 100MB            the cost model's time of each strategy
    p2pcoll timeline trace.json                      merge the ranks' timeline files
    p2pcoll flight DIR                               why a job is stuck: the flight records
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from collections.abc import Sequence

import zmq

from . import __version__
from .engine.costs import DEFAULT_CONSTANTS, CostModel
from .errors import P2PCollError, SettingsError
from .extras import MissingExtra, needs, require
from .launch import launch
from .registry import Registry, registry
from .relay import Relay
from .relay.server import PLAIN_WARNING
from .rendezvous import RendezvousServer
from .security import JobKey, write_key_file
from .settings import RendezvousLimits, Settings, job_key
from .transport.sockets import SocketFactory

PROG = "p2pcoll"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.subcommand in ("bench", "simulate"):
            with needs(f"{PROG} {args.subcommand}"):
                return _bench(extra) if args.subcommand == "bench" else _simulate(extra)
        if extra:
            hint = " (put the command after --)" if args.subcommand == "launch" else ""
            parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    except MissingExtra as exc:
        return _fail_extra(exc)
    if args.subcommand is None:
        parser.print_help(sys.stderr)
        return 2
    handler = {"launch": _launch, "strategies": _strategies, "rendezvous": _rendezvous,
               "keygen": _keygen, "peer": _peer, "relay": _relay, "timeline": _timeline,
               "flight": _flight}
    # Any command: an optional module missing says which extra to install, in one line.
    try:
        with needs(f"{PROG} {args.subcommand}"):
            return handler[args.subcommand](args)
    except MissingExtra as exc:
        return _fail_extra(exc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Peer-to-peer collective communication over ZeroMQ."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")

    launch = sub.add_parser(
        "launch",
        help="start N processes on this host that form one group (like torchrun)",
        description=(
            "Start N copies of COMMAND with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT and P2PCOLL_RENDEZVOUS set, so that p2pcoll.join() needs "
            "no arguments. Output lines are prefixed with the rank. SIGINT, SIGTERM and SIGHUP "
            "are passed on to every rank. When a rank exits non-zero the others are stopped "
            "(SIGTERM, SIGKILL after --grace seconds) and its exit code is returned. As "
            "torchrun does, OMP_NUM_THREADS=1 is set for every rank when N > 1 and it is not "
            "set already (so results do not depend on the launcher); a value you set is kept. "
            "A p2pcoll SettingsError a rank leaves uncaught is printed as one line."
        ),
        usage="%(prog)s [-h] -n N [--rendezvous tcp://HOST:PORT] [--grace SECONDS] "
              "[--no-prefix] [--insecure] -- COMMAND ...",
        epilog="example: p2pcoll launch -n 4 -- python examples/allreduce_demo.py",
    )
    launch.add_argument("-n", "--nprocs", type=_positive_int, required=True, metavar="N",
                        help="number of processes (the world size)")
    launch.add_argument("--rendezvous", metavar="tcp://HOST:PORT",
                        help="where the ranks meet (default: a free port on 127.0.0.1); "
                             "rank 0 hosts it unless a server already listens there")
    launch.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                        help="time between SIGTERM and SIGKILL when stopping ranks "
                             "(default: 5)")
    launch.add_argument("--no-prefix", dest="prefix", action="store_false",
                        help="do not prefix output lines with the rank")
    launch.add_argument("--insecure", dest="secure", action="store_false",
                        help="plain sockets: no job key (by default the ranks get an "
                             "ephemeral one, or the one $P2PCOLL_KEY_FILE names, and every "
                             "socket runs CurveZMQ)")
    launch.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the program to run and its arguments")

    sub.add_parser(
        "strategies",
        help="list the installed strategies of every collective",
        description="List the installed strategies of every collective, what 'auto' picks, "
                    "and the package and entry point each strategy comes from.",
    )

    rendezvous = sub.add_parser(
        "rendezvous",
        help="run a standalone rendezvous server",
        description="Host the rendezvous at tcp://HOST:PORT for peers on other machines, until "
                    "SIGINT or SIGTERM. Peers join it with p2pcoll.join('tcp://HOST:PORT').",
    )
    rendezvous.add_argument("--host", default="0.0.0.0",
                            help="address to listen on (default: 0.0.0.0, every interface)")
    rendezvous.add_argument("--port", type=_port, default=29500,
                            help="port to listen on (default: 29500)")
    rendezvous.epilog = ("With $P2PCOLL_KEY_FILE set it is secured with that job key, and only "
                         "peers holding the same key can join.")

    relay = sub.add_parser(
        "relay",
        help="run a standalone relay for peers that cannot be reached",
        description="Forward the connections of peers that cannot accept any (behind NAT or "
                    "a firewall) for any number of jobs, until SIGINT or SIGTERM. Such peers "
                    "join with P2PCOLL_REACHABLE=0 and P2PCOLL_RELAY=tcp://HOST:PORT. With a "
                    "job key the relay sees only ciphertext (and needs no key).",
    )
    relay.add_argument("--host", default="0.0.0.0",
                       help="address to listen on (default: 0.0.0.0, every interface)")
    relay.add_argument("--port", type=_port, required=True, help="port to listen on")

    keygen = sub.add_parser(
        "keygen",
        help="write a new job key file (mode 0600)",
        description="Write a new CurveZMQ job key to PATH (mode 0600; an existing file is "
                    "never overwritten). Give every peer of the job the file, by path, in "
                    "$P2PCOLL_KEY_FILE (or join(key_file=PATH)): every socket of the job is "
                    "then encrypted and only holders of the key can join. Keys are read "
                    "from files, never from the command line.",
    )
    keygen.add_argument("path", metavar="PATH", help="the file to create")

    peer = sub.add_parser(
        "peer",
        help="run one peer as a service: join, run an async job, leave",
        description=(
            "Join a group (the flags, else the environment: P2PCOLL_RENDEZVOUS, WORLD_SIZE, "
            "RANK, P2PCOLL_KEY_FILE, ... and the launchers' variables), await the job "
            "`async def FUNCTION(group)` of MODULE, leave, and exit with the job's result "
            "(None: 0, an int: itself; 1 on an error). SIGTERM or SIGINT aborts the current "
            "collective, tells the peers this one is leaving (they raise PeerLost naming "
            "it), closes every socket and exits with 128 + the signal's number."
        ),
        epilog="example: p2pcoll peer --job examples.digits_job:job --metrics-port 9100",
    )
    peer.add_argument("--job", required=True, metavar="MODULE:FUNCTION",
                      help="the job: an async function of the group (the current directory "
                           "is searched first)")
    peer.add_argument("--metrics-port", type=_port_or_zero, metavar="N",
                      help="serve /healthz and /metrics over HTTP on port N (0: a free one; "
                           "default $P2PCOLL_METRICS_PORT, else off)")
    peer.add_argument("--metrics-host", metavar="ADDR",
                      help="the address of that port (default $P2PCOLL_METRICS_HOST, else "
                           "0.0.0.0)")
    peer.add_argument("--log-level", metavar="LEVEL", type=str.upper,
                      choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                      help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default "
                           "$P2PCOLL_LOG_LEVEL, else INFO)")
    peer.add_argument("--rendezvous", metavar="tcp://HOST:PORT",
                      help="where the peers meet (default $P2PCOLL_RENDEZVOUS, ...)")
    peer.add_argument("--world-size", type=_positive_int, metavar="N",
                      help="number of peers (default $WORLD_SIZE, ...)")
    peer.add_argument("--rank", type=_non_negative_int, metavar="R",
                      help="this peer's rank (default $RANK, ..., else in arrival order)")
    peer.add_argument("--key-file", metavar="PATH",
                      help="the job key file (default $P2PCOLL_KEY_FILE)")
    peer.add_argument("--job-id", metavar="ID",
                      help="the job at a shared rendezvous server (default $P2PCOLL_JOB_ID)")

    timeline = sub.add_parser(
        "timeline",
        help="merge the ranks' timeline files into one Chrome trace",
        description="Merge the files the ranks wrote for $P2PCOLL_TIMELINE=PATH "
                    "(STEM-GROUP-rankR.json beside PATH) into PATH itself, one track per rank, "
                    "and remove them. p2pcoll launch does this itself; use it after torchrun, "
                    "mpirun or srun. Open the result in https://ui.perfetto.dev or "
                    "chrome://tracing.",
    )
    timeline.add_argument("path", metavar="PATH", help="the timeline path the ranks were given")
    timeline.add_argument("--keep", action="store_true",
                          help="keep the rank files after merging")

    flight = sub.add_parser(
        "flight",
        help="why a job is stuck or failed, from the ranks' flight records",
        description="Read the flight records the ranks wrote to DIR ($P2PCOLL_FLIGHT_DIR=DIR: "
                    "DIR/rank-R.json, when a call fails and on SIGUSR1) and print the first "
                    "collective where the ranks differ, the ranks everyone waits for and the "
                    "ranks whose file is missing. Exits 0 when it could analyse.",
    )
    flight.add_argument("dir", metavar="DIR", help="the directory the ranks wrote to")

    # Its options are added by p2pcoll.bench, imported only when it runs (see _bench).
    sub.add_parser("bench", add_help=False, help="time a collective between peer processes")
    sub.add_parser("simulate", add_help=False,
                   help="predicted time of each strategy from the cost model (no peers)")
    return parser


# --- peer -----------------------------------------------------------------------------------


def _peer(args: argparse.Namespace) -> int:
    from .service import configure_logging, load_job, serve
    from .settings import ServiceSettings

    try:
        service = ServiceSettings.resolve(metrics_port=args.metrics_port,
                                          metrics_host=args.metrics_host,
                                          log_level=args.log_level)
        if service.metrics_port is not None:  # refused before joining anything
            require(f"{PROG} peer's metrics port (--metrics-port, $P2PCOLL_METRICS_PORT)",
                    "aiohttp", "prometheus_client")
        logs = configure_logging(service.log_level)
        job = load_job(args.job)
        options = {k: v for k, v in (("rendezvous", args.rendezvous),
                                     ("world_size", args.world_size), ("rank", args.rank),
                                     ("key_file", args.key_file), ("job_id", args.job_id))
                   if v is not None}
        Settings.resolve(**options)  # a bad setting fails here, before the loop starts
    except SettingsError as exc:
        return _fail(f"peer: {exc}")
    return asyncio.run(serve(job, service=service, join_options=options, name=args.job,
                             logs=logs))


# --- timeline -------------------------------------------------------------------------------


def _timeline(args: argparse.Namespace) -> int:
    from .engine.timeline import merge

    try:
        count = merge(args.path, remove=not args.keep)
    except (OSError, ValueError) as exc:
        return _fail(f"timeline: {exc}")
    if not count:
        return _fail(f"timeline: no rank files for {args.path} (looked for "
                     f"STEM-GROUP-rankR{os.path.splitext(args.path)[1] or '.json'} beside it)")
    print(f"merged {count} rank files into {args.path}")
    return 0


# --- flight ---------------------------------------------------------------------------------


def _flight(args: argparse.Namespace) -> int:
    from .flight import analyse, load, report

    try:
        loaded = load(args.dir)
    except OSError as exc:
        return _fail(f"flight: cannot read {args.dir!r}: {exc.strerror or exc}")
    analysis = analyse(loaded)
    if analysis is None:
        unusable = "".join(f"; {name}: {why}" for name, why in sorted(loaded.bad.items()))
        return _fail(f"flight: no usable rank-R.json in {args.dir!r}{unusable}")
    print(report(args.dir, analysis), end="")
    return 0


# --- launch ---------------------------------------------------------------------------------


def _launch(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _fail("launch: no command given; usage: p2pcoll launch -n N -- COMMAND ...")
    try:
        return launch(args.nprocs, command, rendezvous=args.rendezvous,
                      prefix_output=args.prefix, grace=args.grace, secure=args.secure)
    except (ValueError, P2PCollError) as exc:
        return _fail(f"launch: {exc}")


# --- strategies -----------------------------------------------------------------------------


def _strategies(args: argparse.Namespace) -> int:
    try:
        print(format_strategies(registry), end="")
    except P2PCollError as exc:  # a broken plugin
        return _fail(f"strategies: {exc}")
    return 0


def format_strategies(registry: Registry) -> str:
    """The text of ``p2pcoll strategies``: per collective, what "auto" picks, then each
    strategy with its description and where it comes from; last, the plugins that are
    installed but broken, each with its problem."""
    lines: list[str] = []
    models = {where: CostModel(DEFAULT_CONSTANTS[transport])
              for where, transport in (("one host", "ipc"), ("across hosts", "tcp"))}
    for collective, table in registry.entries().items():
        # "auto" may depend on the data and group sizes and on the links' constants: ask
        # about tiny and huge data in a group of 4 and one of 16, on one host and across.
        said = {}
        for where, model in models.items():
            picks = {}
            for peers in (4, 16):
                small = _auto_pick(registry, collective, 0, peers, model)
                large = _auto_pick(registry, collective, 1 << 40, peers, model)
                picks[peers] = (small if small == large
                                else f"{small} for small data, {large} for large")
            said[where] = (picks[4] if picks[4] == picks[16]
                           else f"4 peers: {picks[4]}; 16 peers: {picks[16]}")
        here, across = said.values()
        auto = here if here == across else f"one host: {here}; across hosts: {across}"
        lines.append(f"{collective} (auto: {auto})")
        if not table:
            lines.append("  (none installed)")
        width = max((len(name) for name in table), default=0)
        for name in sorted(table):
            entry = table[name]
            description = type(entry.strategy).description or "(no description)"
            lines.append(f"  {name:<{width}}  {description}")
            lines.append(f"  {'':<{width}}  from {entry.origin}")
    broken = registry.broken()
    if broken:
        lines.append(f"broken plugins ({len(broken)}, not available):")
        for plugin in broken:
            lines.append(f"  {plugin.where}")
            lines.append(f"    {plugin.problem}")
    return "\n".join(lines) + "\n"


def _auto_pick(registry: Registry, collective: str, nbytes: int, peers: int,
               model: CostModel) -> str:
    """The name "auto" picks, or that name marked as not installed or broken."""
    try:
        return registry.auto(collective, nbytes, peers, model).name
    except P2PCollError:
        name = registry.auto_name(collective, nbytes, peers, model)
        if any((b.collective, b.name) == (collective, name) for b in registry.broken()):
            return f"{name} (broken)"
        return f"{name} (not installed)"


# --- rendezvous -----------------------------------------------------------------------------


def _rendezvous(args: argparse.Namespace) -> int:
    try:
        host = args.host if args.host in ("*", "0.0.0.0") else socket.gethostbyname(args.host)
    except OSError as exc:
        return _fail(f"rendezvous: cannot resolve {args.host!r}: {exc}")
    try:
        key = job_key()  # $P2PCOLL_KEY_FILE, checked like join() checks it
        limits = RendezvousLimits.resolve()  # $P2PCOLL_RENDEZVOUS_*
    except SettingsError as exc:
        return _fail(f"rendezvous: {exc}")
    return asyncio.run(_serve_rendezvous(f"tcp://{host}:{args.port}", key, limits))


async def _serve_rendezvous(url: str, key: JobKey | None = None,
                            limits: RendezvousLimits | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sockets = SocketFactory(key=key)
    server = RendezvousServer(url, sockets, limits)
    try:
        server.bind()
    except zmq.ZMQError as exc:
        sockets.close()
        return _fail(f"rendezvous: cannot listen on {url}: {exc}")
    secured = f"secured with the job key of {key.source}" if key else "not secured"
    print(f"p2pcoll rendezvous: serving at {url}, {secured} (SIGINT or SIGTERM stops it)",
          flush=True)
    try:
        await stop.wait()
    finally:
        await server.aclose()
        sockets.close()
    print("p2pcoll rendezvous: stopped", flush=True)
    return 0


def _relay(args: argparse.Namespace) -> int:
    return asyncio.run(_serve_relay(args.host, args.port))


async def _serve_relay(host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    relay = Relay(host, port)
    try:
        relay.bind()
    except OSError as exc:
        return _fail(f"relay: cannot listen on {host}:{port}: {exc}")
    print(f"p2pcoll relay: relaying on {host}:{port} (SIGINT or SIGTERM stops it); "
          f"{PLAIN_WARNING}", flush=True)
    try:
        await stop.wait()
    finally:
        stats = relay.stats()
        await relay.aclose()
    print(f"p2pcoll relay: stopped after {stats['forwards']} forwards, "
          f"{stats['bytes_relayed']} bytes, refused {stats['refused']}, dials "
          f"{stats['dials']}", flush=True)
    return 0


# --- keygen ---------------------------------------------------------------------------------


def _keygen(args: argparse.Namespace) -> int:
    try:
        key = write_key_file(args.path)
    except FileExistsError:
        return _fail(f"keygen: {args.path} exists; a job key is never overwritten")
    except OSError as exc:
        return _fail(f"keygen: cannot write {args.path}: {exc.strerror or exc}")
    print(f"p2pcoll keygen: wrote a job key to {args.path} (mode 0600; public key "
          f"{key.public.decode()})")
    return 0


# --- bench ----------------------------------------------------------------------------------


def _bench(argv: list[str]) -> int:
    try:
        from . import bench
    except ImportError as exc:
        return _fail(f"bench is not available: {exc}")
    parser = argparse.ArgumentParser(
        prog=f"{PROG} bench", description="Time a collective between peer processes."
    )
    bench.configure_parser(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    return bench.main(args)


# --- simulate -------------------------------------------------------------------------------


def _simulate(argv: list[str]) -> int:
    from .bench import simulate

    parser = argparse.ArgumentParser(
        prog=f"{PROG} simulate",
        description="Predict the time of every strategy of a collective with the "
                    "alpha-beta-gamma cost model (see p2pcoll.engine.costs); no peers run.",
    )
    simulate.configure_parser(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    try:
        return simulate.main(args)
    except (ValueError, P2PCollError) as exc:
        return _fail(f"simulate: {exc}")


# --- helpers --------------------------------------------------------------------------------


def _fail(message: str) -> int:
    print(f"{PROG} {message}", file=sys.stderr)
    return 2


def _fail_extra(exc: MissingExtra) -> int:
    print(f"{PROG}: {exc}", file=sys.stderr)
    return 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def _port_or_zero(text: str) -> int:
    if text.strip() == "0":
        return 0
    return _port(text)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value
