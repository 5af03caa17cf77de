"""Every setting of a group in one frozen, validated value.

``Settings.resolve(...)`` reads the arguments of :func:`p2pcoll.join` and, for what they
leave unset, the environment (``P2PCOLL_*`` and the launchers' variables), once, when a
group is formed. Nothing else in p2pcoll reads ``os.environ``; the layers below get the
value they need from here. A bad value is a :class:`~p2pcoll.SettingsError` naming the
variable (or argument), the value, and what is allowed, raised before any socket exists.

=============================  ======================================================
variable                       meaning (default)
=============================  ======================================================
``P2PCOLL_RENDEZVOUS``         rendezvous URL ``tcp://HOST:PORT`` (else what the
                               launcher implies: torchrun, Open MPI, SLURM; see
                               :mod:`p2pcoll.launchers`)
``P2PCOLL_HOST``               address this peer advertises (the interface routing
                               to the rendezvous host)
``P2PCOLL_HOST_ID``            the host this peer counts as on: peers whose values differ
                               never share memory or ipc (unset: detected, see
                               :func:`p2pcoll.transport.host_identity`)
``P2PCOLL_TRANSPORT``          ``auto``, ``tcp``, ``ipc`` or ``inproc`` (auto)
``P2PCOLL_TIMEOUT``            collective deadline in seconds, > 0 (300)
``P2PCOLL_JOIN_TIMEOUT``       join deadline in seconds, > 0 (60)
``P2PCOLL_<COLLECTIVE>``       default strategy of that collective (auto)
``P2PCOLL_SEGMENT_BYTES``      pipeline segment size, >= 1K (1M)
``P2PCOLL_PIPELINE_DEPTH``     segments in flight per collective, 1..64 (unset: enough
                               to fill the path, at least 4: :mod:`p2pcoll.engine.window`)
``P2PCOLL_MAX_MESSAGE_BYTES``  larger incoming messages are dropped, >= 4K (256M)
``P2PCOLL_EAGER_WINDOW``       bytes a sender may leave unreceived at a peer from earlier
                               operations before its sends wait; 0: unbounded (64M;
                               :mod:`p2pcoll.engine.credit`)
``P2PCOLL_COST_MODEL``         JSON file of alpha, beta, gamma per transport for "auto"
                               (:mod:`p2pcoll.engine.costs`; built-in constants)
``P2PCOLL_TIMELINE``           write every collective's sends, receives and reductions
                               as a Chrome trace (:mod:`p2pcoll.engine.timeline`; off)
``P2PCOLL_FLIGHT_RECORD``      calls each group keeps in its flight record
                               (:mod:`p2pcoll.session.flight`), 0..1000000; 0: off (2000)
``P2PCOLL_FLIGHT_DIR``         write each rank's flight record to ``DIR/rank-R.json``
                               when a call fails and on SIGUSR1 (an existing, writable
                               directory; off)
``P2PCOLL_SHM``                shared-memory rings between peers of one host (1)
``P2PCOLL_SHM_BYTES``          size of each peer's ring, >= 64K (16M)
``P2PCOLL_TCP_LANES``          small messages to peers reached over tcp go on plain TCP
                               lanes in groups without a job key or relay
                               (:mod:`p2pcoll.transport.tcp_lane`; 1)
``P2PCOLL_SPIN``               the most microseconds a small collective on the shared-
                               memory board polls for its peers before it sleeps (the
                               budget within it learned from how late they came), and a
                               receive its peer's TCP lane, 0..10000; 0 never polls (50)
``P2PCOLL_TUNE_MALLOC``        raise glibc's mmap/trim thresholds once (1)
``P2PCOLL_HEARTBEAT_TIMEOUT``  seconds of silence after which a peer is lost, > 0 (5)
``P2PCOLL_MAX_LINKS``          links a peer keeps open to others, the least recently
                               used idle one closed first; >= 4, or 0: no bound (0);
                               each stripe of a link counts
``P2PCOLL_STREAMS``            TCP connections a large message's segments are spread
                               over per peer pair, 1..16, or ``auto``: as many as fill
                               the path, shared among the peers a collective sends to at
                               once, at most 6 a host (:mod:`p2pcoll.transport.paths`;
                               auto)
``P2PCOLL_PROBE``              measure the links at join, for the ring's order and
                               ``auto`` (:mod:`p2pcoll.api.topology`; unset: when the
                               group spans several hosts)
``P2PCOLL_REACHABLE``          0: this peer cannot accept connections (NAT, a firewall):
                               the others reach it through a relay (docs/relay.md;
                               unset: the rendezvous checks it can connect back)
``P2PCOLL_RELAY``              ``tcp://HOST:PORT`` of the relay an unreachable peer uses
                               (unset: the rendezvous host's)
``P2PCOLL_KEY_FILE``           the job key file (``p2pcoll keygen``): secure every socket
``P2PCOLL_JOB_ID``             which job of a shared rendezvous server this peer joins
``P2PCOLL_MIN_WORLD_SIZE``     elastic groups: form with at least this many peers
``P2PCOLL_MAX_WORLD_SIZE``     elastic groups: form with at most this many peers
``P2PCOLL_RENDEZVOUS_*``       what a rendezvous server accepts: ``MAX_WORLD_SIZE`` (4096),
                               ``MAX_HEARTBEAT`` (300 s), ``MAX_PEERS`` (16384 waiting),
                               ``MAX_JOBS`` (1024 forming), ``RATE`` (20 requests/s per
                               connection); see :class:`RendezvousLimits`
``P2PCOLL_METRICS_PORT``       a peer service's HTTP port for /healthz and /metrics (off)
``P2PCOLL_METRICS_HOST``       the address that port is bound to (0.0.0.0)
``P2PCOLL_LOG_LEVEL``          a peer service's log level (INFO)
``P2PCOLL_METRICS_*``          that HTTP server's limits: ``MAX_CONNECTIONS`` (64),
                               ``CLIENT_CONNECTIONS`` (8 per client address),
                               ``TIMEOUT`` (5 s per connection), ``RATE`` (20
                               connections/s), ``CACHE`` (1 s); see :class:`ServiceSettings`
=============================  ======================================================

The metrics and log variables are a peer service's (:class:`ServiceSettings`,
``p2pcoll peer``), not a group's.

Byte counts take ``K``, ``M``, ``G`` suffixes (powers of 1024, ``KiB`` and ``KB`` alike);
switches take ``1/0``, ``true/false``, ``yes/no``, ``on/off``.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from . import launchers
from .errors import SettingsError
from .errors import bad_value as bad_value  # still importable from here
from .launchers import RANK_VARS, WORLD_SIZE_VARS  # noqa: F401 (still importable from here)
from .security.keys import JobKey
from .settings_env import (LINKS_ALLOWED, MAX_PIPELINE_DEPTH, EnvReader, check_directory,
                           check_host_id, check_int, check_job_id, check_streams)
from .settings_env import MAX_STREAMS as MAX_STREAMS
from .settings_env import MIN_LINKS as MIN_LINKS  # these still importable from here
from .settings_env import check_path as check_path
from .settings_env import check_seconds as check_seconds
from .settings_env import format_bytes as format_bytes
from .settings_env import parse_bytes as parse_bytes
from .strategy import COLLECTIVES

log = logging.getLogger("p2pcoll")

TRANSPORT_NAMES = ("auto", "tcp", "ipc", "inproc")
_RELAY_URL = re.compile(r"tcp://[A-Za-z0-9._-]+:([1-9][0-9]{0,4})")
MAX_FLIGHT_RECORD = 1_000_000  # calls a flight record keeps at most (~200 bytes each)

# Every variable this module knows, for the warning about unknown ones.
KNOWN_VARS = frozenset(
    {
        "P2PCOLL_RENDEZVOUS", "P2PCOLL_HOST", "P2PCOLL_HOST_ID", "P2PCOLL_TRANSPORT",
        "P2PCOLL_TIMEOUT",
        "P2PCOLL_JOIN_TIMEOUT", "P2PCOLL_SEGMENT_BYTES", "P2PCOLL_PIPELINE_DEPTH",
        "P2PCOLL_EAGER_WINDOW",
        "P2PCOLL_MAX_MESSAGE_BYTES", "P2PCOLL_COST_MODEL", "P2PCOLL_TIMELINE", "P2PCOLL_SHM",
        "P2PCOLL_FLIGHT_RECORD", "P2PCOLL_FLIGHT_DIR", "P2PCOLL_TCP_LANES",
        "P2PCOLL_SHM_BYTES", "P2PCOLL_SPIN", "P2PCOLL_TUNE_MALLOC", "P2PCOLL_MAX_LINKS",
        "P2PCOLL_HEARTBEAT_TIMEOUT", "P2PCOLL_KEY_FILE", "P2PCOLL_JOB_ID",
        "P2PCOLL_REACHABLE", "P2PCOLL_RELAY",
        "P2PCOLL_STREAMS",
        "P2PCOLL_MIN_WORLD_SIZE", "P2PCOLL_MAX_WORLD_SIZE",
        "P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE", "P2PCOLL_RENDEZVOUS_MAX_HEARTBEAT",
        "P2PCOLL_RENDEZVOUS_MAX_PEERS", "P2PCOLL_RENDEZVOUS_MAX_JOBS", "P2PCOLL_RENDEZVOUS_RATE",
        "P2PCOLL_METRICS_PORT", "P2PCOLL_METRICS_HOST", "P2PCOLL_LOG_LEVEL",
        "P2PCOLL_METRICS_MAX_CONNECTIONS", "P2PCOLL_METRICS_CLIENT_CONNECTIONS",
        "P2PCOLL_METRICS_TIMEOUT", "P2PCOLL_METRICS_RATE", "P2PCOLL_METRICS_CACHE",
        "P2PCOLL_PROBE",
        "P2PCOLL_LAUNCHED",  # set by `p2pcoll launch` for its children (see launch.py)
        *(f"P2PCOLL_{c.upper()}" for c in COLLECTIVES),
    }
)


@dataclass(frozen=True)
class Settings:
    """What one group runs with. Made by :meth:`resolve`; fields are validated there.

    Attributes:
        rendezvous: ``tcp://HOST:PORT``, or None (allowed only for a group of one).
        world_size: the number of peers, or None when the rendezvous learns it from others.
        rank: this peer's rank, or None to be assigned in arrival order.
        host: the address to advertise, or None to use the interface that routes to the
            rendezvous host.
        host_id: the host this peer says it is on, or None to leave it to detection. Peers
            whose values differ count as on different hosts: they reach each other over tcp
            only, never over ipc or shared memory (rings, lanes, the board), even when they
            could (network namespaces, containers of one machine that share /dev/shm).
            Peers with equal values are told apart by detection as without it (see
            :func:`p2pcoll.transport.host_identity`).
        transport: one of ``auto``, ``tcp``, ``ipc``, ``inproc``.
        join_timeout: seconds for the whole group to form.
        collective_timeout: default deadline of every collective, seconds.
        strategies: default strategy per collective (arguments over environment).
        segment_bytes: pipeline segment size.
        pipeline_depth: segments of one collective in flight at once; None: as many as
            fill the paths to its peers, at least 4 (see :mod:`p2pcoll.engine.window`).
        eager_window: the bytes this rank may leave unreceived at a peer from earlier
            operations before its sends wait for credit; 0: no bound (see
            :mod:`p2pcoll.engine.credit`).
        max_message_bytes: no message is larger: outgoing data is cut to fit, incoming
            messages larger than this are dropped (and libzmq refuses far larger frames).
        cost_model: path of the JSON file of cost-model constants "auto" uses, or "" for
            the built-in ones (loaded and checked when the group is made).
        timeline: path of the Chrome trace of every collective (see
            :mod:`p2pcoll.engine.timeline`; each rank writes a file beside it), or "".
        flight_record: how many calls the flight record keeps (0: none; see
            :mod:`p2pcoll.session.flight`).
        flight_dir: the directory each rank writes its flight record to when a call
            fails and on SIGUSR1, or "".
        shm: whether peers of one host use shared-memory rings.
        shm_bytes: the size of each peer's ring.
        tcp_lanes: whether small messages to peers reached over tcp go on plain TCP lanes
            (:mod:`p2pcoll.transport.tcp_lane`) in groups without a job key and without
            a relay (on by default; ``P2PCOLL_TCP_LANES=0`` turns them off).
        spin_us: the most (microseconds) a collective on the shared-memory board polls
            its peers' slots before it sleeps; the budget within it is learned from how
            late they recently came (hybrid waiting: :mod:`p2pcoll.engine.waiting`); a
            receive polls its peer's TCP lane likewise (:mod:`p2pcoll.engine.polling`).
        tune_malloc: whether to raise glibc's mmap and trim thresholds.
        heartbeat_timeout: seconds without a sign of life after which a peer (or the
            rendezvous host) counts as lost, while joining and after.
        probe: whether the group measures its links at join (``P2PCOLL_PROBE``); None:
            when it spans several hosts (:mod:`p2pcoll.api.topology`).
        max_links: the most links this peer keeps open to other peers (0: no bound; else
            at least 4). Links open on demand; beyond this, the least recently used link
            that may go (idle, to a peer this one does not watch, without a shared-memory
            lane) is closed, and opened again when next needed (see
            :mod:`p2pcoll.transport.route`). Each stripe of a link counts as a link.
        streams: the TCP connections (stripes) a large message's segments are spread over
            per peer pair, 1 to :data:`MAX_STREAMS`, or ``"auto"``: as many as fill the
            path's bandwidth-delay product, 1 on one host (see
            :mod:`p2pcoll.transport.paths`).
        key: the job key every socket uses (CurveZMQ), or None for an insecure group.
        job_id: the job to join at a rendezvous server that serves several.
        min_world_size, max_world_size: for an elastic group (``world_size`` None): it
            forms once ``max_world_size`` peers are there, or ``min_world_size`` are and no
            more arrived for a moment (see :mod:`p2pcoll.rendezvous.server`).
        order: where this peer goes when ranks are assigned (lower first, then arrival);
            the elastic training layer passes the previous rank.
        expect: an elastic group forms as soon as this many peers are there (at least
            ``min_world_size``), without the moment of quiet; the elastic training layer
            passes the survivors and the peers it counted waiting.
        torchrun: under torchrun, its run id and restart count (the namespace of this
            job's keys in torchrun's store, see :mod:`p2pcoll.rendezvous.torch_store`).
        rendezvous_limits: what the rendezvous server this peer may host accepts; this
            peer's own world size and heartbeat must be within them.
        reachable: False: this peer cannot accept connections (behind NAT, a firewall):
            it listens on no network address and the others reach it through a relay
            (see docs/relay.md); None or True: it can.
        relay: ``tcp://HOST:PORT`` of the relay (``p2pcoll relay``) a peer that is not
            reachable registers at, or None for the one the rendezvous host runs.
    """

    rendezvous: str | None = None
    world_size: int | None = None
    rank: int | None = None
    host: str | None = None
    host_id: str | None = None
    transport: str = "auto"
    join_timeout: float = 60.0
    collective_timeout: float = 300.0
    strategies: Mapping[str, str] = field(default_factory=dict)
    segment_bytes: int = 1 << 20
    pipeline_depth: int | None = None
    eager_window: int = 64 << 20
    max_message_bytes: int = 256 << 20
    cost_model: str = ""
    timeline: str = ""
    flight_record: int = 2000
    flight_dir: str = ""
    shm: bool = True
    shm_bytes: int = 16 << 20
    tcp_lanes: bool = True
    spin_us: int = 50
    tune_malloc: bool = True
    heartbeat_timeout: float = 5.0
    max_links: int = 0
    streams: int | Literal["auto"] = "auto"
    key: JobKey | None = None
    job_id: str = ""
    min_world_size: int | None = None
    max_world_size: int | None = None
    order: int | None = None
    expect: int | None = None
    torchrun: str = ""
    rendezvous_limits: RendezvousLimits = field(default_factory=lambda: RendezvousLimits())
    reachable: bool | None = None
    relay: str | None = None
    probe: bool | None = None

    @classmethod
    def resolve(
        cls, environ: Mapping[str, str] | None = None, **arguments: Any
    ) -> Settings:
        """Settings from keyword ``arguments`` (None meaning unset) over ``environ``.

        ``arguments`` are the field names above, and ``key_file`` (a path: the job key is
        read from it, over ``$P2PCOLL_KEY_FILE``); ``environ`` defaults to ``os.environ``.

        Raises:
            SettingsError: a value is malformed or out of range; the message names the
                variable or argument, the value and what is allowed.
            TypeError: an unknown argument name.
        """
        env = os.environ if environ is None else environ
        strays = sorted(k for k in env if k.startswith("P2PCOLL_") and k not in KNOWN_VARS)
        if strays:  # most likely a typo: say so rather than ignore it silently
            log.warning("ignoring unknown environment variables %s", ", ".join(strays))
        unknown = set(arguments) - {f for f in cls.__dataclass_fields__} - {"key_file"}
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}")
        given = {k: v for k, v in arguments.items() if v is not None}
        reader = EnvReader(env)
        values: dict[str, Any] = {
            "rendezvous": reader.raw("P2PCOLL_RENDEZVOUS"),  # else the launcher's, below
            "host": reader.raw("P2PCOLL_HOST"),
            "host_id": reader.host_id(),
            "transport": reader.choice("P2PCOLL_TRANSPORT", TRANSPORT_NAMES),
            "join_timeout": reader.seconds("P2PCOLL_JOIN_TIMEOUT"),
            "collective_timeout": reader.seconds("P2PCOLL_TIMEOUT"),
            "strategies": reader.strategies(),
            "segment_bytes": reader.size("P2PCOLL_SEGMENT_BYTES", minimum=1 << 10),
            "pipeline_depth": reader.integer("P2PCOLL_PIPELINE_DEPTH", 1, MAX_PIPELINE_DEPTH),
            "eager_window": reader.size("P2PCOLL_EAGER_WINDOW", minimum=0),
            "max_message_bytes": reader.size("P2PCOLL_MAX_MESSAGE_BYTES", minimum=4 << 10),
            "cost_model": reader.raw("P2PCOLL_COST_MODEL"),
            "timeline": reader.path("P2PCOLL_TIMELINE"),
            "flight_record": reader.integer("P2PCOLL_FLIGHT_RECORD", 0, MAX_FLIGHT_RECORD),
            "flight_dir": reader.directory("P2PCOLL_FLIGHT_DIR"),
            "shm": reader.switch("P2PCOLL_SHM"),
            "probe": reader.switch("P2PCOLL_PROBE"),
            "shm_bytes": reader.size("P2PCOLL_SHM_BYTES", minimum=64 << 10),
            "tcp_lanes": reader.switch("P2PCOLL_TCP_LANES"),
            "spin_us": reader.integer("P2PCOLL_SPIN", 0, 10_000),
            "tune_malloc": reader.switch("P2PCOLL_TUNE_MALLOC"),
            "heartbeat_timeout": reader.seconds("P2PCOLL_HEARTBEAT_TIMEOUT"),
            "max_links": reader.links("P2PCOLL_MAX_LINKS"),
            "streams": reader.streams("P2PCOLL_STREAMS"),
            "key": reader.key(),
            "job_id": reader.job_id(),
            "min_world_size": reader.integer("P2PCOLL_MIN_WORLD_SIZE", 1, 1 << 20),
            "max_world_size": reader.integer("P2PCOLL_MAX_WORLD_SIZE", 1, 1 << 20),
            "rendezvous_limits": RendezvousLimits.resolve(env),
            "reachable": reader.switch("P2PCOLL_REACHABLE"),
            "relay": reader.raw("P2PCOLL_RELAY"),
        }
        merged = {k: v for k, v in values.items() if v is not None}
        if "strategies" in given:
            merged["strategies"] = {**values["strategies"], **_check_strategies(
                given.pop("strategies"))}
        for name in ("timeline", "flight_dir"):
            if name in given:
                given[name] = os.fspath(given[name])
        key_file = given.pop("key_file", None)
        if key_file is not None:
            merged["key"] = JobKey.load(key_file, where="key_file=")
        merged.update(given)
        _from_launcher(merged, env)
        settings = cls(**merged)
        settings._check_arguments(given)
        if settings.relay is not None and not _RELAY_URL.fullmatch(settings.relay):
            raise bad_value("relay=" if "relay" in given else "$P2PCOLL_RELAY",
                            settings.relay, "tcp://HOST:PORT (where `p2pcoll relay` runs)")
        if "reachable" in given and not isinstance(given["reachable"], bool):
            raise bad_value("reachable=", given["reachable"], "True or False")
        return settings

    def _check_arguments(self, given: Mapping[str, Any]) -> None:
        """Validate what came from arguments (the environment is checked as it is read)."""
        for name in ("join_timeout", "collective_timeout"):
            if name in given:
                check_seconds(given[name], f"{name}=")
        if "world_size" in given:
            check_int(given["world_size"], "world_size=", 1)
        if "rank" in given:
            check_int(given["rank"], "rank=", 0)
        if "transport" in given and given["transport"] not in TRANSPORT_NAMES:
            raise bad_value(
                "transport=", given["transport"], f"one of {', '.join(TRANSPORT_NAMES)}"
            )
        for name, low in (("segment_bytes", 1 << 10), ("max_message_bytes", 4 << 10),
                          ("shm_bytes", 64 << 10), ("eager_window", 0)):
            if name in given:
                check_int(given[name], f"{name}=", low)
        if "pipeline_depth" in given:
            check_int(given["pipeline_depth"], "pipeline_depth=", 1, MAX_PIPELINE_DEPTH)
        if "spin_us" in given:
            check_int(given["spin_us"], "spin_us=", 0, 10_000)
        if "max_links" in given:
            links = given["max_links"]
            if not (type(links) is int and (links == 0 or MIN_LINKS <= links <= 1 << 20)):
                raise bad_value("max_links=", links, LINKS_ALLOWED)
        if "streams" in given:
            check_streams(given["streams"], "streams=")
        if given.get("timeline"):  # made a str by resolve()
            check_path(given["timeline"], "timeline=")
        if "flight_record" in given:
            check_int(given["flight_record"], "flight_record=", 0, MAX_FLIGHT_RECORD)
        if given.get("flight_dir"):
            check_directory(given["flight_dir"], "flight_dir=")
        if "heartbeat_timeout" in given:
            check_seconds(given["heartbeat_timeout"], "heartbeat_timeout=")
        if math.isinf(self.heartbeat_timeout):  # from either: a peer must be lost at some point
            where = "heartbeat_timeout=" if "heartbeat_timeout" in given else \
                "$P2PCOLL_HEARTBEAT_TIMEOUT"
            raise bad_value(where, self.heartbeat_timeout, "a finite number of seconds > 0")
        for name in ("min_world_size", "max_world_size", "order", "expect"):
            if name in given:
                check_int(given[name], f"{name}=", 0 if name == "order" else 1)
        if "host_id" in given:
            check_host_id(given["host_id"], "host_id=")
        if "job_id" in given:
            check_job_id(given["job_id"], "job_id=")
        if "key" in given and not isinstance(given["key"], JobKey):
            raise bad_value("key=", given["key"], "a p2pcoll.security.JobKey")
        least, most = self.min_world_size, self.max_world_size
        if least is not None and most is not None and least > most:
            raise SettingsError(
                f"min_world_size {least} is larger than max_world_size {most}",
                name="min_world_size", value=least, allowed=f"at most {most}")
        if (self.rendezvous is not None and self.rendezvous.startswith("tcp://")
                and self.rank in (None, 0)):
            self._check_rendezvous_limits(given)

    def _check_rendezvous_limits(self, given: Mapping[str, Any]) -> None:
        """What this peer will ask of the rendezvous it may host (rank None or 0: see
        :mod:`p2pcoll.session.forming`) is within that server's bounds, its own settings:
        its own server would refuse it; better said here, naming the setting. Another
        peer's limits are those of whoever hosts, a standalone server maybe: its error
        reply names the bound."""
        limits = self.rendezvous_limits
        for name in ("world_size", "min_world_size", "max_world_size"):
            value = getattr(self, name)
            if value is not None and value > limits.max_world_size:
                raise bad_value(f"{name}=" if name in given else name, value,
                                f"at most {limits.max_world_size}, the largest world a "
                                f"rendezvous accepts ($P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE)")
        if self.heartbeat_timeout > limits.max_heartbeat:
            where = "heartbeat_timeout=" if "heartbeat_timeout" in given else \
                "$P2PCOLL_HEARTBEAT_TIMEOUT"
            raise bad_value(where, self.heartbeat_timeout,
                            f"at most {limits.max_heartbeat:g} seconds, the longest heartbeat "
                            f"a rendezvous accepts ($P2PCOLL_RENDEZVOUS_MAX_HEARTBEAT)")


@dataclass(frozen=True)
class RendezvousLimits:
    """What a rendezvous server (:mod:`p2pcoll.rendezvous.server`) accepts from its
    clients and holds at once. A request over a bound gets an ``error`` reply naming the
    bound and its variable; a peer that may host the rendezvous (rank None or 0) and whose
    own settings ask for more fails in :meth:`Settings.resolve`. Made by :meth:`resolve`.

    Attributes:
        max_world_size: the largest world size (or elastic minimum or maximum) a join may
            ask for (``$P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE``, 4096).
        max_heartbeat: the longest heartbeat a join may ask for, in seconds
            (``$P2PCOLL_RENDEZVOUS_MAX_HEARTBEAT``, 300): a registration is dropped that
            long after its last request at the latest.
        max_peers: registrations held at once, over every job
            (``$P2PCOLL_RENDEZVOUS_MAX_PEERS``, 16384; at least ``max_world_size``).
        max_jobs: jobs with a group forming at once (``$P2PCOLL_RENDEZVOUS_MAX_JOBS``, 1024).
        rate: requests per second one connection (one routing identity) may send, in
            bursts of as many (``$P2PCOLL_RENDEZVOUS_RATE``, 20; a joining peer sends 2);
            more are dropped, and the first of them answered with an error.
    """

    max_world_size: int = 4096
    max_heartbeat: float = 300.0
    max_peers: int = 16384
    max_jobs: int = 1024
    rate: float = 20.0

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None) -> RendezvousLimits:
        """The limits ``$P2PCOLL_RENDEZVOUS_*`` set (defaults for those unset); a
        standalone ``p2pcoll rendezvous`` reads them so.

        Raises:
            SettingsError: a value out of its range, naming the variable.
        """
        reader = EnvReader(os.environ if environ is None else environ)
        values: dict[str, Any] = {
            "max_world_size": reader.integer("P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE", 1, 1 << 20),
            "max_peers": reader.integer("P2PCOLL_RENDEZVOUS_MAX_PEERS", 1, 1 << 24),
            "max_jobs": reader.integer("P2PCOLL_RENDEZVOUS_MAX_JOBS", 1, 1 << 20),
            "max_heartbeat": reader.number("P2PCOLL_RENDEZVOUS_MAX_HEARTBEAT"),
            "rate": reader.number("P2PCOLL_RENDEZVOUS_RATE"),
        }
        limits = cls(**{k: v for k, v in values.items() if v is not None})
        if limits.max_peers < limits.max_world_size:
            raise bad_value("$P2PCOLL_RENDEZVOUS_MAX_PEERS", limits.max_peers,
                            f"at least $P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE "
                            f"({limits.max_world_size}): one whole group must fit")
        return limits


def job_key(environ: Mapping[str, str] | None = None) -> JobKey | None:
    """The job key of ``$P2PCOLL_KEY_FILE`` alone (for a standalone rendezvous server,
    which has no group settings), checked as :meth:`Settings.resolve` checks it.

    Raises:
        SettingsError: the file is missing, malformed or readable by every user.
    """
    return EnvReader(os.environ if environ is None else environ).key()


def _check_strategies(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise bad_value("strategies=", value, "a mapping {collective: strategy name}")
    for coll, name in value.items():
        if coll not in COLLECTIVES:
            raise bad_value(f"strategies[{coll!r}]", name, f"a key from {COLLECTIVES}")
        if not isinstance(name, str) or not name:
            raise bad_value(f"strategies[{coll!r}]", name, "a strategy name")
    return dict(value)


def _from_launcher(merged: dict[str, Any], env: Mapping[str, str]) -> None:
    """Fill in the rank, world size and rendezvous that arguments and ``P2PCOLL_*`` left
    unset from what the launcher's environment implies (:func:`p2pcoll.launchers.detect`)."""
    elastic = merged.get("min_world_size") is not None or \
        merged.get("max_world_size") is not None
    found = launchers.detect(env, elastic=elastic)
    merged.setdefault("torchrun", found.torchrun)
    # Given both, the caller made this group (the torch backend, Ray actors), not the
    # launcher: a URL worked out from the launcher's job would not be theirs.
    explicit = merged.get("rank") is not None and merged.get("world_size") is not None
    for name in ("rank", "world_size"):
        if merged.get(name) is None:
            merged[name] = getattr(found, name)
    size = merged["world_size"]
    if size is None and found.world_size_needed and not elastic:
        raise SettingsError(found.world_size_needed, name=found.world_size_from,
                            allowed="an integer >= 1")
    if merged.get("rendezvous") is None and size != 1 and not (explicit and found.derived):
        merged["rendezvous"] = found.find_rendezvous()
    if found.launcher:
        log.debug("launcher %s: rank %s from %s, world size %s from %s, rendezvous %s",
                  found.launcher, found.rank, found.rank_from or "-", found.world_size,
                  found.world_size_from or "-", merged.get("rendezvous"))


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class ServiceSettings:
    """What a peer run as a service (:class:`p2pcoll.service.Peer`) runs with, besides its
    group's :class:`Settings`. Made by :meth:`resolve`.

    Attributes:
        metrics_port: the HTTP port of ``/healthz`` and ``/metrics``; None: no HTTP server;
            0: any free port.
        metrics_host: the address that port is bound to (all interfaces by default, so a
            container's health check and a Prometheus scraper can reach it).
        log_level: the level of the service's log lines (a :mod:`logging` level name).
        metrics_max_connections: connections the HTTP server holds open at once
            (``$P2PCOLL_METRICS_MAX_CONNECTIONS``, 1..4096); one more is closed as soon as
            it is accepted, and counted.
        metrics_client_connections: of those, how many one client address may hold
            (``$P2PCOLL_METRICS_CLIENT_CONNECTIONS``, 1..4096); over it, likewise.
        metrics_timeout: seconds a connection has for its one request, from its accept
            to the last byte of the answer (``$P2PCOLL_METRICS_TIMEOUT``, finite, > 0):
            then it is closed (a request that never finishes its headers included), and
            counted.
        metrics_rate: connections (each carries one request) accepted per second on
            average, in bursts of up to as many (``$P2PCOLL_METRICS_RATE``, > 0); while
            it is spent nothing is accepted (the connections wait in the kernel's queue,
            at no cost to the peer), and each such pause is counted.
        metrics_cache: seconds an answer of ``/metrics`` or ``/healthz`` is served again
            while the peer's state is unchanged (``$P2PCOLL_METRICS_CACHE``, >= 0): the
            peer does the work of at most one of each per that time, however many ask.
    """

    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    log_level: str = "INFO"
    metrics_max_connections: int = 64
    metrics_client_connections: int = 8
    metrics_timeout: float = 5.0
    metrics_rate: float = 20.0
    metrics_cache: float = 1.0

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, *,
                metrics_port: int | None = None, metrics_host: str | None = None,
                log_level: str | None = None) -> ServiceSettings:
        """Arguments (None meaning unset) over ``$P2PCOLL_METRICS_PORT``,
        ``$P2PCOLL_METRICS_HOST`` and ``$P2PCOLL_LOG_LEVEL``; the HTTP server's limits
        from ``$P2PCOLL_METRICS_MAX_CONNECTIONS``, ``..._CLIENT_CONNECTIONS``,
        ``..._TIMEOUT``, ``..._RATE`` and ``..._CACHE``.

        Raises:
            SettingsError: a port outside 0..65535, an empty host, an unknown level, or a
                limit out of its range (the message names the variable).
        """
        reader = EnvReader(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        if metrics_port is not None:
            values["metrics_port"] = check_int(metrics_port, "metrics_port=", 0, 65535)
        else:
            values["metrics_port"] = reader.integer("P2PCOLL_METRICS_PORT", 0, 65535)
        host = metrics_host if metrics_host is not None else reader.raw("P2PCOLL_METRICS_HOST")
        if host is not None:
            if not isinstance(host, str) or not host.strip():
                raise bad_value("metrics_host=", host, "an address to bind, like 0.0.0.0")
            values["metrics_host"] = host.strip()
        where, level = ("log_level=", log_level) if log_level is not None else (
            "$P2PCOLL_LOG_LEVEL", reader.raw("P2PCOLL_LOG_LEVEL"))
        if level is not None:
            if not isinstance(level, str) or level.upper() not in LOG_LEVELS:
                raise bad_value(where, level, f"one of {', '.join(LOG_LEVELS)}")
            values["log_level"] = level.upper()
        for name in ("MAX_CONNECTIONS", "CLIENT_CONNECTIONS"):
            values[f"metrics_{name.lower()}"] = reader.integer(f"P2PCOLL_METRICS_{name}",
                                                               1, 4096)
        for name, zero_ok, unit in (("TIMEOUT", False, "seconds"),
                                    ("RATE", False, "connections per second"),
                                    ("CACHE", True, "seconds")):
            values[f"metrics_{name.lower()}"] = reader.number(
                f"P2PCOLL_METRICS_{name}", unit=unit, zero_ok=zero_ok)
        return cls(**{k: v for k, v in values.items() if v is not None})
