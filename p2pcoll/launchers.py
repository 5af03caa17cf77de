"""What each launcher's environment says: this peer's rank, the world size, where to meet.

:meth:`p2pcoll.Settings.resolve` asks :func:`detect` for what the arguments of
:func:`p2pcoll.join` and ``$P2PCOLL_RENDEZVOUS`` leave unset. Under each launcher below a
peer needs no variable of p2pcoll's own; where the environment cannot say where the group
meets, the settings fail at once with a :class:`~p2pcoll.SettingsError` saying what to set.

==================  ====================  ====================  ==============================
source              rank                  world size            rendezvous
==================  ====================  ====================  ==============================
join() arguments    rank=                 world_size=           rendezvous=
p2pcoll variables   (by arrival)          (from other peers)    P2PCOLL_RENDEZVOUS
torchrun            RANK                  WORLD_SIZE            torchrun's store, at
                                                                MASTER_ADDR:MASTER_PORT
Open MPI mpirun     OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_SIZE  one node: 127.0.0.1:PORT(job);
                                                                several: rank 0's host by MPI
SLURM srun          SLURM_PROCID          SLURM_NTASKS          first node:PORT(job)
Kubeflow TrainJob   PET_NODE_RANK         PET_NNODES            PET_MASTER_ADDR:PET_MASTER_PORT
(torch runtime)
JobSet, given       JOB_COMPLETION_INDEX  WORLD_SIZE (needed)   JOBSET-RJOB-0-0.JOBSET:29500
JOBSET_NAME         (one Job: replicas 1)
Indexed Job         JOB_COMPLETION_INDEX  WORLD_SIZE (needed)   P2PCOLL_RENDEZVOUS (needed)
StatefulSet         N of hostname NAME-N  WORLD_SIZE (needed)   P2PCOLL_RENDEZVOUS (needed)
nothing             0                     1 (warns once)        none: a group of one
==================  ====================  ====================  ==============================

PORT(job) is a port derived from the job's id, below. Each row fills only what the rows
above it leave unset, so ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``
(torch's convention, which ``p2pcoll launch`` and many launchers besides torchrun set;
without torchrun's ``TORCHELASTIC_RUN_ID`` they mean ``tcp://MASTER_ADDR:MASTER_PORT``) win
over a launcher's own variables. The launchers exclude each other: the first in the table
whose variables are there is the launcher, and only its variables are read (the four
Kubernetes rows only while ``$RANK`` is unset, and never for an elastic group, which takes
no rank from a pod's name or index). A URL worked out from a launcher's job is used only
when the launcher gave the rank or the world size: given both as arguments, the caller made
the group (the torch backend, Ray actors in a SLURM job), so it is not the job's.

Where the rows are ambiguous:

- **Open MPI before SLURM.** ``mpirun`` inside a SLURM allocation leaves the allocation's
  ``SLURM_PROCID`` (0 in a batch script) and ``SLURM_NTASKS`` in every rank's environment;
  ``OMPI_COMM_WORLD_*`` are the ranks' own. ``srun`` starting the processes directly sets no
  ``OMPI_COMM_WORLD_*``, so the order never hides SLURM's answer when SLURM started them.
- **SLURM's rendezvous** is the first host of ``$SLURM_STEP_NODELIST`` (else
  ``$SLURM_JOB_NODELIST``), expanded from Slurm's compressed syntax (:func:`first_host`).
  Task 0 runs there with srun's block and cyclic distributions (the default is block); with
  another distribution set ``P2PCOLL_RENDEZVOUS``: rank 0 checks ``$SLURMD_NODENAME`` and
  says so. The port is the first of ``$SLURM_STEP_RESV_PORTS`` (``srun --resv-ports``: Slurm
  reserves it for the step) when there is one, else ``20000 + SLURM_JOB_ID % 10000``:
  steps of one job that use p2pcoll at the same time need ``P2PCOLL_RENDEZVOUS`` or
  ``--resv-ports``. The node's name must resolve to the same address on every node.
- **Open MPI's rendezvous.** All ranks on one node (``$OMPI_COMM_WORLD_LOCAL_SIZE`` equal to
  ``$OMPI_COMM_WORLD_SIZE``): loopback, port ``20000 + crc32(PMIX_NAMESPACE) % 10000``
  (Open MPI 5 names each job ``prterun-HOST-PID@N``; Open MPI 4's
  ``$OMPI_MCA_ess_base_jobid`` stands in). On several nodes nothing in the environment
  says where rank 0 is. If the program has initialized MPI itself (``from mpi4py import
  MPI``), rank 0's host name is broadcast over ``MPI.COMM_WORLD``, which blocks until every
  rank has called ``join()``. p2pcoll never initializes MPI itself: ``MPI_Init`` takes
  about a second, may hook the allocator, and makes every exit without ``MPI_Finalize``
  (a signal, ``os._exit``) abort the whole job. Otherwise the error says to pass
  ``mpirun -x P2PCOLL_RENDEZVOUS=tcp://HOST:PORT``.
- **Kubeflow Trainer** (v2, the ``torch`` runtime of a TrainJob) gives every node's
  container ``PET_NNODES`` (numNodes), ``PET_NODE_RANK`` (the pod's index in its Job),
  ``PET_NPROC_PER_NODE`` and ``PET_MASTER_ADDR``/``PET_MASTER_PORT``
  (``TRAINJOB-node-0-0.TRAINJOB:29500``, the first pod under the JobSet's headless Service).
  These are torchrun's variables: the runtime does not start torchrun, the TrainJob's
  command does or does not. Under ``torchrun``, torchrun reads them and sets ``RANK`` and the
  rest (the torchrun row). Started directly (``p2pcoll peer``, ``python train.py``) the
  container's command is one process: one peer per pod, rank ``PET_NODE_RANK`` of
  ``PET_NNODES``, so ``PET_NPROC_PER_NODE`` must be 1 (``numProcPerNode: 1``; Kubeflow sets
  it to the pod's CPUs otherwise), else the error says so.
- **JobSet** sets no variable of its own, but names its pods ``JOBSET-RJOB-J-P`` (``RJOB``
  the replicatedJob, ``J`` the Job's index, ``P`` the pod's, ``$JOB_COMPLETION_INDEX``) and,
  by default, gives them DNS names under a headless Service named after the JobSet
  (``network.subdomain``). With ``$JOBSET_NAME`` (the pod's label
  ``jobset.sigs.k8s.io/jobset-name``, passed by the downward API) the hostname is read: the
  group is one Job (``replicas: 1``; ``parallelism`` and ``completions`` its size, and
  ``WORLD_SIZE``), rank ``P``, meeting at pod ``JOBSET-RJOB-0-0.JOBSET`` on port 29500. A pod
  of a later Job (``J`` > 0) is an error: several Jobs need ``RANK`` set by the manifest.
  With another ``network.subdomain``, set ``P2PCOLL_RENDEZVOUS``.
- **Indexed Job**: ``$JOB_COMPLETION_INDEX``, which Kubernetes sets in every pod of an Indexed
  Job, is the rank. The manifest sets ``WORLD_SIZE`` (the Job's completions) and
  ``P2PCOLL_RENDEZVOUS`` (``tcp://JOB-0.SERVICE:PORT``, with the pod template's
  ``subdomain`` a headless Service); without them the error names them.
- **StatefulSet** is recognized by ``$KUBERNETES_SERVICE_HOST`` and a pod's hostname
  ``NAME-N`` (``$HOSTNAME``, else :func:`socket.gethostname`). A pod cannot know its
  StatefulSet's size or Service, so the manifest sets ``WORLD_SIZE`` and
  ``P2PCOLL_RENDEZVOUS`` (``tcp://NAME-0.SERVICE:PORT``); without them the error names them.
- **Nothing.** A process that no launcher started and that no argument or variable gives a
  world size or a rendezvous is a group of one: ``join()`` warns once (:func:`warn_alone`,
  naming what is missing); ``join(world_size=1)`` says it is meant and is silent. A rank
  without a world size (``RANK=1`` alone, say) is a :class:`~p2pcoll.SettingsError` naming
  both variables: it would otherwise be rank 0 of a group of one.

A malformed value (``SLURM_PROCID=x``, a nodelist that is not Slurm's syntax) is a
:class:`~p2pcoll.SettingsError` naming the variable. A rank not below the world size (each
value fine alone) is the ``RendezvousError`` that ``join()`` raises at once, before any
socket, as the API pins.
"""

from __future__ import annotations

import re
import socket
import sys
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from .errors import SettingsError, bad_value

# Every variable that can give the rank or the world size, in the order they are tried.
RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PET_NODE_RANK",
             "JOB_COMPLETION_INDEX")
WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PET_NNODES")

PORT_BASE, PORT_SPAN = 20000, 10000  # derived ports: below Linux's ephemeral range
RENDEZVOUS_PORT = 29500  # a JobSet's: torch's and Kubeflow's, and the image's EXPOSE
_POD = re.compile(r"(.+)-(\d+)")
# Slurm's hostlists: hosts joined by commas; a host is text and bracketed ranges of numbers.
_HOST = r"(?:[^\s,\[\]]|\[[^\[\]]*\])+"
_HOSTLIST = re.compile(rf"{_HOST}(?:,{_HOST})*")
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGES = re.compile(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*")


def _none() -> str | None:
    return None


@dataclass(frozen=True)
class Launch:
    """What one environment implies. ``*_from`` name where each value came from.

    Attributes:
        launcher: ``"torchrun"``, ``"env"`` (torch's variables without torchrun),
            ``"openmpi"``, ``"slurm"``, ``"kubeflow"``, ``"jobset"``, ``"indexed-job"``,
            ``"kubernetes"`` (a StatefulSet), or ``""``.
        rank, world_size: None where the environment does not say.
        rank_from, world_size_from: the variable, like ``"$SLURM_PROCID"``.
        find_rendezvous: returns the rendezvous URL the environment implies (None: it
            implies none), or raises SettingsError saying what to set. Called only when
            nothing above gives one, since finding it may cost something (an MPI broadcast).
        derived: the URL is worked out from a launcher's job (Open MPI, SLURM, Kubernetes),
            not given by variables (``MASTER_ADDR``/``MASTER_PORT``).
        world_size_needed: when not empty, a group that ends up with no world size (and is
            not elastic) is an error with this message.
        torchrun: under torchrun, ``"RUN_ID/RESTART"`` (see :mod:`.rendezvous.torch_store`).
    """

    launcher: str = ""
    rank: int | None = None
    rank_from: str = ""
    world_size: int | None = None
    world_size_from: str = ""
    find_rendezvous: Callable[[], str | None] = field(default=_none, compare=False)
    derived: bool = False
    world_size_needed: str = ""
    torchrun: str = ""

    def under(self, launcher: Launch) -> Launch:
        """These values, and ``launcher``'s where these are unset."""
        pick_rank = self if self.rank is not None else launcher
        pick_size = self if self.world_size is not None else launcher
        own_url = self.find_rendezvous is not _none
        return replace(
            launcher,
            # the one that gave the rank: WORLD_SIZE alone (a pod's manifest) names none
            launcher=self.launcher if self.rank is not None or not launcher.launcher
            else launcher.launcher,
            rank=pick_rank.rank, rank_from=pick_rank.rank_from,
            world_size=pick_size.world_size, world_size_from=pick_size.world_size_from,
            find_rendezvous=self.find_rendezvous if own_url else launcher.find_rendezvous,
            derived=False if own_url else launcher.derived,
            world_size_needed="" if self.world_size is not None else launcher.world_size_needed,
            torchrun=self.torchrun,
        )


def detect(env: Mapping[str, str], *, elastic: bool = False) -> Launch:
    """torch's variables over the first launcher found, in the table's order.

    ``elastic``: the group will be elastic, so no rank is taken from a pod's name or index.
    A rank with no world size leaves ``world_size_needed`` saying so.

    Raises:
        SettingsError: a launcher's variable is malformed, or missing beside the others.
    """
    generic = torchrun(env)
    launcher = openmpi(env) or slurm(env)
    if launcher is None and (generic is None or generic.rank is None) and not elastic:
        launcher = kubeflow(env) or jobset(env) or indexed_job(env) or kubernetes(env)
    found = (generic or Launch()).under(launcher or Launch())
    if found.rank is not None and found.world_size is None and not found.world_size_needed:
        # Alone it would be rank 0 of a group of one, whatever the variable said.
        size = found.world_size_from or "$WORLD_SIZE"
        found = replace(found, world_size_from=size, world_size_needed=(
            f"{found.rank_from}={found.rank} gives this process's rank, but nothing gives the "
            f"world size: set {size.lstrip('$')} too (or pass world_size= to join())"))
    return found


def _raw(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    value = _raw(env, name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise bad_value(f"${name}", value, f"an integer >= {minimum}")
    return number


def _port(env: Mapping[str, str], name: str) -> int:
    value = _raw(env, name) or ""
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise bad_value(f"${name}", value, "a TCP port number 1..65535")
    return int(value)


# --- torchrun, and torch's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT convention --------


def torchrun(env: Mapping[str, str]) -> Launch | None:
    """``$RANK``, ``$WORLD_SIZE`` and ``MASTER_ADDR:MASTER_PORT``; under torchrun (its
    ``$TORCHELASTIC_RUN_ID``) the rendezvous is torchrun's own store, ``torch://``."""
    run = _raw(env, "TORCHELASTIC_RUN_ID")
    namespace = "" if run is None else f"{run}/{_raw(env, 'TORCHELASTIC_RESTART_COUNT') or 0}"
    rank, size = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
    addr = _raw(env, "MASTER_ADDR")
    has_url = addr is not None and _raw(env, "MASTER_PORT") is not None
    if rank is None and size is None and not has_url and run is None:
        return None

    def rendezvous() -> str:
        # Under torchrun its agent's store holds MASTER_PORT: meet through it.
        return f"{'torch' if run else 'tcp'}://{addr}:{_port(env, 'MASTER_PORT')}"

    return Launch(
        launcher="torchrun" if run else "env",
        rank=rank, rank_from="$RANK", world_size=size, world_size_from="$WORLD_SIZE",
        find_rendezvous=rendezvous if has_url else _none, torchrun=namespace,
    )


# --- Open MPI ------------------------------------------------------------------------------


def openmpi(env: Mapping[str, str]) -> Launch | None:
    """``mpirun``'s ``$OMPI_COMM_WORLD_RANK`` and ``_SIZE``; the rendezvous as the module
    docstring says."""
    rank = _int(env, "OMPI_COMM_WORLD_RANK", 0)
    size = _int(env, "OMPI_COMM_WORLD_SIZE", 1)
    if rank is None and size is None:
        return None
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)

    def rendezvous() -> str | None:
        job = _raw(env, "PMIX_NAMESPACE") or _raw(env, "OMPI_MCA_ess_base_jobid")
        if job is None:  # not mpirun's whole environment: let join() say what to set
            return None
        port = PORT_BASE + zlib.crc32(job.encode()) % PORT_SPAN
        if local is not None and local == size:
            return f"tcp://127.0.0.1:{port}"
        host = _mpi_root_host(env)
        if host is None:
            nodes = "" if local is None else (
                f" (OMPI_COMM_WORLD_LOCAL_SIZE={local} of OMPI_COMM_WORLD_SIZE={size})")
            raise SettingsError(
                f"under mpirun on several nodes{nodes} nothing says where rank 0 runs: run "
                f"mpirun -x P2PCOLL_RENDEZVOUS=tcp://HOST:PORT with HOST the node of rank 0 "
                f"and a free PORT, or initialize MPI before join() (from mpi4py import MPI) "
                f"so that rank 0's host is sent to the others through MPI",
                name="$P2PCOLL_RENDEZVOUS", allowed="tcp://HOST:PORT")
        return f"tcp://{host}:{port}"

    return Launch(
        launcher="openmpi",
        rank=rank, rank_from="$OMPI_COMM_WORLD_RANK",
        world_size=size, world_size_from="$OMPI_COMM_WORLD_SIZE",
        find_rendezvous=rendezvous, derived=True,
    )


def _mpi_root_host(env: Mapping[str, str]) -> str | None:
    """Rank 0's host name, broadcast over MPI.COMM_WORLD, if the program has initialized
    MPI through mpi4py; else None (p2pcoll never initializes MPI itself)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    comm = mpi.COMM_WORLD
    mine = (_raw(env, "P2PCOLL_HOST") or socket.gethostname()) if comm.Get_rank() == 0 else None
    return str(comm.bcast(mine, root=0))


# --- SLURM ---------------------------------------------------------------------------------


def slurm(env: Mapping[str, str]) -> Launch | None:
    """``srun``'s ``$SLURM_PROCID`` and ``$SLURM_NTASKS``; the rendezvous on the step's first
    node, as the module docstring says."""
    rank = _int(env, "SLURM_PROCID", 0)
    size = _int(env, "SLURM_NTASKS", 1)
    if rank is None and size is None:
        return None

    def rendezvous() -> str | None:
        name = "SLURM_STEP_NODELIST" if _raw(env, "SLURM_STEP_NODELIST") else \
            "SLURM_JOB_NODELIST"
        nodelist = _raw(env, name)
        port = slurm_port(env)
        if nodelist is None or port is None:  # not srun's whole environment: let join()
            return None                       # say what to set
        host = first_host(nodelist, f"${name}")
        node = _raw(env, "SLURMD_NODENAME")
        if rank == 0 and node is not None and node != host:
            raise _missing(f"SLURM task 0 runs on {node}, not on {host}, the first node of "
                           f"${name} (a task distribution other than block or cyclic?)")
        return f"tcp://{host}:{port}"

    return Launch(
        launcher="slurm",
        rank=rank, rank_from="$SLURM_PROCID", world_size=size, world_size_from="$SLURM_NTASKS",
        find_rendezvous=rendezvous, derived=True,
    )


def slurm_port(env: Mapping[str, str]) -> int | None:
    """The first port of ``$SLURM_STEP_RESV_PORTS``, else ``20000 + SLURM_JOB_ID % 10000``
    (None without either)."""
    reserved = _raw(env, "SLURM_STEP_RESV_PORTS")
    if reserved is not None:
        first = reserved.split(",")[0].split("-")[0]
        if not first.isdigit() or not 0 < int(first) < 65536:
            raise bad_value("$SLURM_STEP_RESV_PORTS", reserved, "ports like 12000-12003")
        return int(first)
    job = _int(env, "SLURM_JOB_ID", 0)
    return None if job is None else PORT_BASE + job % PORT_SPAN


def _missing(why: str) -> SettingsError:
    return SettingsError(f"{why}: set P2PCOLL_RENDEZVOUS=tcp://HOST:PORT, with HOST the node "
                         f"of rank 0 and a free PORT", name="$P2PCOLL_RENDEZVOUS",
                         allowed="tcp://HOST:PORT")


def first_host(nodelist: str, name: str = "nodelist") -> str:
    """The first host of a Slurm hostlist; the whole list is checked.

    ``node[01-04,07],gpu[1-2]`` -> ``node01``; ``a-b[3-5]`` -> ``a-b3``;
    ``rack[2-3]-n[08-09]`` -> ``rack2-n08``; ``login1,login2`` -> ``login1``. Numbers keep
    their zero padding as written.

    Raises:
        SettingsError: ``nodelist`` is not Slurm's syntax; the message names ``name``.
    """
    ranges = [m.group(1) for m in _BRACKET.finditer(nodelist)]
    if not _HOSTLIST.fullmatch(nodelist) or not all(map(_ascending, ranges)):
        raise bad_value(name, nodelist, "a Slurm hostlist like node[01-04,07],gpu1")
    first = re.match(_HOST, nodelist).group(0)  # type: ignore[union-attr]
    # Each bracket's first value is the low end of its first range, as written.
    return _BRACKET.sub(lambda m: re.split("[,-]", m.group(1))[0], first)


def _ascending(ranges: str) -> bool:
    """``01-04,07`` is; ``4-1``, ``a``, ``1,`` and the empty string are not."""
    if not _RANGES.fullmatch(ranges):
        return False
    pairs = (part.split("-") for part in ranges.split(","))
    return all(int(pair[0]) <= int(pair[-1]) for pair in pairs)


# --- Kubernetes: Kubeflow's TrainJob, JobSet, Indexed Job, StatefulSet ----------------------


def _hostname(env: Mapping[str, str]) -> str:
    return _raw(env, "HOSTNAME") or socket.gethostname()


def kubeflow(env: Mapping[str, str]) -> Launch | None:
    """A node of a Kubeflow TrainJob (the torch runtime) started without torchrun: one peer
    per pod, rank ``$PET_NODE_RANK`` of ``$PET_NNODES``, meeting at
    ``PET_MASTER_ADDR:PET_MASTER_PORT`` (see the module docstring).

    Raises:
        SettingsError: a ``PET_*`` variable is malformed or missing, or
            ``$PET_NPROC_PER_NODE`` asks for more than one process per pod.
    """
    nodes, node = _int(env, "PET_NNODES", 1), _int(env, "PET_NODE_RANK", 0)
    if nodes is None and node is None:
        return None
    for name, value in (("PET_NNODES", nodes), ("PET_NODE_RANK", node)):
        if value is None:
            raise SettingsError(
                f"a Kubeflow TrainJob sets PET_NNODES and PET_NODE_RANK together, but ${name} "
                f"is not set", name=f"${name}", allowed="an integer")
    per_node = _raw(env, "PET_NPROC_PER_NODE")
    if per_node not in (None, "1"):
        raise bad_value("$PET_NPROC_PER_NODE", per_node,
                   "1: p2pcoll runs one peer per pod (set numProcPerNode: 1 in the TrainJob's "
                   "trainer), unless torchrun starts the processes (its command: torchrun ...)")

    def rendezvous() -> str:
        host = _raw(env, "PET_MASTER_ADDR")
        if host is None:
            raise SettingsError("a Kubeflow TrainJob's node without $PET_MASTER_ADDR: set "
                                "P2PCOLL_RENDEZVOUS=tcp://HOST:PORT", name="$PET_MASTER_ADDR",
                                allowed="the host of node 0")
        return f"tcp://{host}:{_port(env, 'PET_MASTER_PORT')}"

    return Launch(
        launcher="kubeflow",
        rank=node, rank_from="$PET_NODE_RANK", world_size=nodes, world_size_from="$PET_NNODES",
        find_rendezvous=rendezvous, derived=True,
    )


def jobset(env: Mapping[str, str]) -> Launch | None:
    """A pod of a JobSet (``$JOBSET_NAME``, given by the manifest) named
    ``JOBSET-RJOB-0-P``: rank ``P`` (``$JOB_COMPLETION_INDEX``), meeting at
    ``JOBSET-RJOB-0-0.JOBSET:29500``; ``$WORLD_SIZE`` from the manifest.

    Raises:
        SettingsError: the hostname is not a JobSet pod's, does not match
            ``$JOB_COMPLETION_INDEX``, or is a pod of a Job other than the first.
    """
    name = _raw(env, "JOBSET_NAME")
    if name is None:
        return None
    hostname, index = _hostname(env), _int(env, "JOB_COMPLETION_INDEX", 0)
    m = re.fullmatch(rf"{re.escape(name)}-(.+)-(\d+)-(\d+)", hostname)
    if m is None or index is None or int(m.group(3)) != index:
        raise SettingsError(
            f"$JOBSET_NAME={name} is set, but this pod (hostname {hostname}, "
            f"$JOB_COMPLETION_INDEX={index}) is not one of its pods {name}-RJOB-JOB-POD of an "
            f"Indexed Job (JobSet's default completionMode)", name="$JOBSET_NAME", value=name,
            allowed="the name of this pod's JobSet")
    replicated, job = m.group(1), int(m.group(2))
    where = f"JobSet pod {hostname} (rank {index}, the pod's index in its Job)"
    if job != 0:
        raise SettingsError(
            f"{where} is in Job {job} of replicatedJob {replicated}: p2pcoll takes the rank "
            f"from the pod's index in one Job; make the group one Job (replicas: 1, parallelism "
            f"and completions the world size) or set RANK in the pod template",
            name="$RANK", allowed="an integer")

    def rendezvous() -> str:
        return f"tcp://{name}-{replicated}-0-0.{name}:{RENDEZVOUS_PORT}"

    return Launch(
        launcher="jobset",
        rank=index, rank_from="$JOB_COMPLETION_INDEX",
        find_rendezvous=rendezvous, derived=True,
        world_size_needed=f"{where}: set WORLD_SIZE to the Job's completions in the pod "
                          f"template",
    )


def indexed_job(env: Mapping[str, str]) -> Launch | None:
    """A pod of an Indexed Job: ``$JOB_COMPLETION_INDEX`` as the rank; ``$WORLD_SIZE`` and
    ``$P2PCOLL_RENDEZVOUS`` from the manifest."""
    index = _int(env, "JOB_COMPLETION_INDEX", 0)
    if index is None:
        return None
    hostname = _hostname(env)
    m = _POD.fullmatch(hostname)  # JOB-N, when the pod template sets a subdomain
    job = m.group(1) if m is not None and int(m.group(2)) == index else "JOB"
    where = f"Kubernetes Indexed Job pod {hostname} (rank {index} from $JOB_COMPLETION_INDEX)"

    def rendezvous() -> str:
        raise SettingsError(
            f"{where}: set P2PCOLL_RENDEZVOUS=tcp://{job}-0.SERVICE:PORT in the pod template "
            f"(SERVICE: a headless Service, the pod template's subdomain)",
            name="$P2PCOLL_RENDEZVOUS", allowed="tcp://HOST:PORT")

    return Launch(
        launcher="indexed-job",
        rank=index, rank_from="$JOB_COMPLETION_INDEX",
        find_rendezvous=rendezvous, derived=True,
        world_size_needed=f"{where}: set WORLD_SIZE to the Job's completions in the pod "
                          f"template",
    )


def kubernetes(env: Mapping[str, str]) -> Launch | None:
    """The ordinal ``N`` of a StatefulSet pod's hostname ``NAME-N`` as the rank, under
    Kubernetes (``$KUBERNETES_SERVICE_HOST``); ``$WORLD_SIZE`` and ``$P2PCOLL_RENDEZVOUS``
    from the manifest."""
    if _raw(env, "KUBERNETES_SERVICE_HOST") is None:
        return None
    hostname = _hostname(env)
    m = _POD.fullmatch(hostname)
    if m is None:
        return None
    name, ordinal = m.group(1), int(m.group(2))
    where = f"Kubernetes pod {hostname} (StatefulSet {name}, rank {ordinal} from the hostname)"

    def rendezvous() -> str:
        raise SettingsError(
            f"{where}: set P2PCOLL_RENDEZVOUS=tcp://{name}-0.SERVICE:PORT in the pod "
            f"template (SERVICE: the StatefulSet's headless Service)",
            name="$P2PCOLL_RENDEZVOUS", allowed="tcp://HOST:PORT")

    return Launch(
        launcher="kubernetes",
        rank=ordinal, rank_from="$HOSTNAME" if _raw(env, "HOSTNAME") else "the hostname",
        world_size=_int(env, "WORLD_SIZE", 1), world_size_from="$WORLD_SIZE",
        find_rendezvous=rendezvous, derived=True,
        world_size_needed=f"{where}: set WORLD_SIZE to the StatefulSet's replicas in the pod "
                          f"template",
    )


# --- nothing -------------------------------------------------------------------------------

ALONE = (
    "p2pcoll.join(): nothing says how many peers the group has (no world_size= argument, no "
    "rendezvous, and no launcher's variables: WORLD_SIZE, OMPI_COMM_WORLD_SIZE, SLURM_NTASKS, "
    "PET_NNODES), so this process is a group of one. Pass world_size=1 if that is meant, or "
    "start the processes with a launcher (p2pcoll launch, torchrun, mpirun, srun)"
)


def warn_alone() -> None:
    """Say that a group of one is forming which nobody asked for (see the module docstring).
    A UserWarning with one text from one place: Python shows it once per process."""
    warnings.warn(ALONE, UserWarning, stacklevel=2)
