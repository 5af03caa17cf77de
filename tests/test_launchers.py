"""Under SLURM, Open MPI, Kubeflow's TrainJob, JobSet, an Indexed Job and a StatefulSet,
join() needs no variable of p2pcoll's own, and where the environment cannot say where to
meet, the error says what to set. A rank without a world size is an error; a group of one
that nothing asked for is a warning.

First :func:`p2pcoll.launchers.detect` and ``Settings.resolve`` on explicit environments (so
the test process's own variables never leak in), then real runs of the demo: three processes
with an ``srun``-like environment, three with a StatefulSet's, a TrainJob's and an Indexed
Job's, and ``mpirun -n 3`` for real.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import types
import zlib
from pathlib import Path
from typing import Any

import pytest

from p2pcoll import launchers
from p2pcoll.errors import SettingsError
from p2pcoll.launchers import first_host
from p2pcoll.settings import Settings
from p2pcoll.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "examples" / "allreduce_demo.py")
PASSED = "every check passed on all 3 ranks"
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
# Variables of any launcher: none may leak from the environment the tests run in.
FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "HOSTNAME")
FOREIGN_PREFIXES = ("P2PCOLL_", "SLURM_", "SLURMD_", "OMPI_", "PMIX_", "TORCHELASTIC_",
                    "KUBERNETES_", "PET_", "JOB_COMPLETION_INDEX", "JOBSET_")

SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "123456",
        "SLURM_STEP_NODELIST": "node[07-10]", "SLURM_JOB_NODELIST": "node[01-10]"}
MPIRUN_ENV = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
              "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "PMIX_NAMESPACE": "prterun-vm-10537@1"}
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "p2pcoll-2", "WORLD_SIZE": "4"}
POD_NO_SIZE = {k: v for k, v in POD.items() if k != "WORLD_SIZE"}


def resolve(env: dict[str, str], **arguments: Any) -> tuple[str | None, int | None, int | None]:
    s = Settings.resolve(env, **arguments)
    return s.rendezvous, s.world_size, s.rank


# --- SLURM ---------------------------------------------------------------------------------

def test_srun() -> None:
    assert resolve(SRUN) == ("tcp://node07:" + str(20000 + 123456 % 10000), 4, 1)
    assert launchers.detect(SRUN).launcher == "slurm"


def test_srun_port_and_nodes() -> None:
    job_only = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"}
    assert resolve(job_only)[0] == "tcp://node01:23456"  # a batch step: the job's nodes
    reserved = {**SRUN, "SLURM_STEP_RESV_PORTS": "12000-12003"}
    assert resolve(reserved)[0] == "tcp://node07:12000"  # srun --resv-ports
    assert resolve({**SRUN, "SLURM_JOB_ID": "29999"})[0] == "tcp://node07:29999"
    assert resolve({**SRUN, "SLURM_JOB_ID": "30000"})[0] == "tcp://node07:20000"


def test_srun_overridden() -> None:
    assert resolve({**SRUN, "P2PCOLL_RENDEZVOUS": "tcp://10.0.0.1:5"})[0] == "tcp://10.0.0.1:5"
    assert resolve({**SRUN, "MASTER_ADDR": "h", "MASTER_PORT": "7"})[0] == "tcp://h:7"
    assert resolve(SRUN, rendezvous="tcp://a:1", world_size=9, rank=8) == ("tcp://a:1", 9, 8)
    assert resolve(SRUN, world_size=1) == (None, 1, 1)  # alone, nobody to meet
    assert resolve({**SRUN, "RANK": "3", "WORLD_SIZE": "5"})[1:] == (5, 3)


@pytest.mark.parametrize("env", [SRUN, MPIRUN_ENV, POD,
                                 {**MPIRUN_ENV, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}])
def test_a_group_the_caller_made_takes_no_url_from_the_job(env: dict[str, str]) -> None:
    """Rank and world size both given (the torch backend, Ray actors inside a SLURM job):
    the launcher's job is not this group's, so no URL is worked out (nor any error)."""
    assert resolve(env, world_size=2, rank=1) == (None, 2, 1)
    torch_style = {**env, "MASTER_ADDR": "m", "MASTER_PORT": "9"}
    assert resolve(torch_style, world_size=2, rank=1) == ("tcp://m:9", 2, 1)


def test_a_launcher_rank_with_a_world_size_argument_still_meets_where_the_job_says() -> None:
    assert resolve(SRUN, world_size=2) == ("tcp://node07:23456", 2, 1)


def test_srun_without_its_whole_environment_leaves_join_to_say_what_to_set() -> None:
    """Only SLURM_PROCID and SLURM_NTASKS (not what srun sets): no URL is made up."""
    assert resolve({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == (None, 2, 1)


def test_rank_0_on_another_node_is_an_error_at_once() -> None:
    env = {**SRUN, "SLURM_PROCID": "0", "SLURMD_NODENAME": "node09"}
    with pytest.raises(SettingsError, match="task 0 runs on node09, not on node07") as caught:
        resolve(env)
    assert "P2PCOLL_RENDEZVOUS=tcp://HOST:PORT" in str(caught.value)
    assert resolve({**env, "SLURMD_NODENAME": "node07"})[0] == "tcp://node07:23456"
    assert resolve({**env, "SLURM_PROCID": "1"})[0] == "tcp://node07:23456"  # not rank 0


@pytest.mark.parametrize(("nodelist", "first"), [
    ("node[01-04,07],gpu[1-2]", "node01"),
    ("a-b[3-5]", "a-b3"),
    ("localhost", "localhost"),
    ("127.0.0.1", "127.0.0.1"),
    ("login1,login2", "login1"),
    ("node[007-100]", "node007"),
    ("node[9-10]", "node9"),
    ("node[5]", "node5"),
    ("node[3,1-2]", "node3"),  # Slurm keeps the order as written
    ("rack[2-3]-n[08-09]", "rack2-n08"),
    ("gpu[1-2],node[01-04]", "gpu1"),
    ("x.example.org,y", "x.example.org"),
])
def test_first_host(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", [
    "node[01-04", "node01-04]", "node[]", "node[a-b]", "node[4-1]", "node[1-2-3]", "node[1,]",
    "node[[1]]", ",node1", "node1,", "node1,,node2", "node 1", "node[1-2]x]",
])
def test_malformed_nodelist(nodelist: str) -> None:
    with pytest.raises(SettingsError) as caught:
        resolve({**SRUN, "SLURM_STEP_NODELIST": nodelist})
    assert "$SLURM_STEP_NODELIST" in str(caught.value)
    assert repr(nodelist) in str(caught.value)
    assert "Slurm hostlist" in str(caught.value)
    # Not needed, not read: an explicit rendezvous makes the nodelist irrelevant.
    assert resolve({**SRUN, "SLURM_STEP_NODELIST": nodelist}, rendezvous="tcp://a:1")[0]


@pytest.mark.parametrize(("var", "value"), [
    ("SLURM_PROCID", "x"), ("SLURM_PROCID", "-1"), ("SLURM_NTASKS", "0"),
    ("SLURM_NTASKS", "four"), ("SLURM_JOB_ID", "abc"), ("SLURM_STEP_RESV_PORTS", "ports"),
    ("SLURM_STEP_RESV_PORTS", "70000"),
])
def test_bad_slurm_values(var: str, value: str) -> None:
    with pytest.raises(SettingsError) as caught:
        resolve({**SRUN, var: value})
    assert f"${var}={value!r}" in str(caught.value)
    assert caught.value.name == f"${var}"


# --- Open MPI ------------------------------------------------------------------------------

def test_mpirun_on_one_node() -> None:
    port = 20000 + zlib.crc32(b"prterun-vm-10537@1") % 10000
    assert resolve(MPIRUN_ENV) == (f"tcp://127.0.0.1:{port}", 3, 2)
    open_mpi_4 = {**MPIRUN_ENV, "OMPI_MCA_ess_base_jobid": "2871263233"}
    del open_mpi_4["PMIX_NAMESPACE"]
    assert resolve(open_mpi_4)[0] == f"tcp://127.0.0.1:{20000 + zlib.crc32(b'2871263233') % 10000}"
    other_job = resolve({**MPIRUN_ENV, "PMIX_NAMESPACE": "prterun-vm-10538@1"})[0]
    assert other_job != resolve(MPIRUN_ENV)[0]


def test_mpirun_on_several_nodes_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)  # MPI not initialized
    env = {**MPIRUN_ENV, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(SettingsError) as caught:
        resolve(env)
    assert "mpirun -x P2PCOLL_RENDEZVOUS=tcp://HOST:PORT" in str(caught.value)
    assert "OMPI_COMM_WORLD_LOCAL_SIZE=1 of OMPI_COMM_WORLD_SIZE=3" in str(caught.value)
    assert resolve({**env, "P2PCOLL_RENDEZVOUS": "tcp://n1:9"})[0] == "tcp://n1:9"


def test_mpirun_on_several_nodes_through_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    """With MPI initialized by the program, rank 0's host comes over COMM_WORLD (here a
    stand-in; the real one runs under mpirun below)."""
    sent: list[object] = []

    class World:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def Get_rank(self) -> int:  # mpi4py's name
            return self.rank

        def bcast(self, value: object, root: int) -> object:
            sent.append(value)
            return "rank0host" if self.rank else value

    for rank, initialized in ((0, True), (1, True), (1, False)):
        fake = types.SimpleNamespace(COMM_WORLD=World(rank), Is_initialized=lambda i=initialized: i,
                                     Is_finalized=lambda: False)
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
        env = {**MPIRUN_ENV, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_RANK": str(rank),
               "P2PCOLL_HOST": "rank0host"}
        if not initialized:
            with pytest.raises(SettingsError, match="initialize MPI"):
                resolve(env)
        else:
            assert str(resolve(env)[0]).startswith("tcp://rank0host:")
    assert sent == ["rank0host", None]


def test_open_mpi_comes_before_slurm() -> None:
    """mpirun inside a SLURM allocation: the allocation's SLURM_PROCID (0 in a batch script)
    is in every rank's environment, but the ranks are Open MPI's."""
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "5",
             "SLURM_JOB_NODELIST": "n[1-2]"}
    assert resolve({**batch, **MPIRUN_ENV})[1:] == (3, 2)
    assert launchers.detect({**batch, **MPIRUN_ENV}).launcher == "openmpi"


@pytest.mark.parametrize(("var", "value"), [
    ("OMPI_COMM_WORLD_RANK", "two"), ("OMPI_COMM_WORLD_RANK", "-1"),
    ("OMPI_COMM_WORLD_SIZE", "0"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "x"),
])
def test_bad_open_mpi_values(var: str, value: str) -> None:
    with pytest.raises(SettingsError) as caught:
        resolve({**MPIRUN_ENV, var: value})
    assert f"${var}={value!r}" in str(caught.value)


# --- Kubernetes ----------------------------------------------------------------------------

@pytest.mark.parametrize(("hostname", "rank"), [
    ("p2pcoll-2", 2), ("p2pcoll-0", 0), ("train-v2-3", 3), ("a-b-c-01", 1),
    ("web-7d9f8b6c5-x2x9z", None),  # a Deployment's pod: no ordinal
    ("p2pcoll", None), ("p2pcoll-", None), ("-3", None), ("p2pcoll-2a", None),
])
def test_pod_hostname(hostname: str, rank: int | None) -> None:
    env = {**POD, "HOSTNAME": hostname, "P2PCOLL_RENDEZVOUS": "tcp://p2pcoll-0.svc:29500"}
    assert resolve(env) == ("tcp://p2pcoll-0.svc:29500", 4, rank)


def test_pod_needs_kubernetes() -> None:
    env = {"HOSTNAME": "p2pcoll-2", "WORLD_SIZE": "4", "P2PCOLL_RENDEZVOUS": "tcp://h:1"}
    assert resolve(env)[2] is None  # a laptop called p2pcoll-2 is no pod
    assert launchers.detect(env).launcher == "env"


def test_pod_rank_env_wins() -> None:
    env = {**POD, "RANK": "1", "P2PCOLL_RENDEZVOUS": "tcp://h:1"}
    assert resolve(env)[2] == 1
    assert resolve(env, rank=3)[2] == 3


def test_pod_hostname_from_the_system(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "job-5")
    env = {k: v for k, v in POD.items() if k != "HOSTNAME"}
    assert resolve({**env, "WORLD_SIZE": "6", "P2PCOLL_RENDEZVOUS": "tcp://h:1"})[2] == 5


def test_pod_says_what_to_set() -> None:
    with pytest.raises(SettingsError) as caught:
        resolve(POD)
    msg = str(caught.value)
    assert "P2PCOLL_RENDEZVOUS=tcp://p2pcoll-0.SERVICE:PORT" in msg and "p2pcoll-2" in msg
    no_size = {**POD, "P2PCOLL_RENDEZVOUS": "tcp://h:1"}
    del no_size["WORLD_SIZE"]
    with pytest.raises(SettingsError, match="set WORLD_SIZE to the StatefulSet's replicas"):
        resolve(no_size)
    assert resolve(no_size, world_size=4)[1:] == (4, 2)
    # An elastic group takes no rank from the name and needs no world size.
    assert resolve(no_size, min_world_size=2)[1:] == (None, None)


# --- Kubeflow Trainer's TrainJob (the torch runtime) ----------------------------------------

# What Kubeflow Trainer's Torch plugin gives node 1 of TrainJob "tj" with numNodes: 3.
TRAINJOB = {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29500",
            "JOB_COMPLETION_INDEX": "1", "HOSTNAME": "tj-node-0-1",
            "KUBERNETES_SERVICE_HOST": "10.96.0.1"}


def test_trainjob() -> None:
    assert resolve(TRAINJOB) == ("tcp://tj-node-0-0.tj:29500", 3, 1)
    assert launchers.detect(TRAINJOB).launcher == "kubeflow"
    assert resolve({k: v for k, v in TRAINJOB.items() if k != "PET_NPROC_PER_NODE"})[1:] == \
        (3, 1)


def test_trainjob_under_torchrun_is_torchruns() -> None:
    """The TrainJob's command ran torchrun, which read PET_* and set RANK and the rest: its
    processes per node are its own business."""
    env = {**TRAINJOB, "PET_NPROC_PER_NODE": "4", "TORCHELASTIC_RUN_ID": "tj",
           "RANK": "5", "WORLD_SIZE": "12", "MASTER_ADDR": "tj-node-0-0.tj",
           "MASTER_PORT": "29500"}
    assert resolve(env) == ("torch://tj-node-0-0.tj:29500", 12, 5)
    assert launchers.detect(env).launcher == "torchrun"


@pytest.mark.parametrize(("var", "value", "allowed"), [
    ("PET_NNODES", "0", ">= 1"), ("PET_NNODES", "three", ">= 1"),
    ("PET_NODE_RANK", "-1", ">= 0"),
    ("PET_NPROC_PER_NODE", "4", "numProcPerNode: 1"),
    ("PET_NPROC_PER_NODE", "auto", "numProcPerNode: 1"),
    ("PET_MASTER_PORT", "http", "1..65535"), ("PET_MASTER_PORT", "", "1..65535"),
    ("PET_NODE_RANK", None, "PET_NODE_RANK is not set"),
    ("PET_NNODES", None, "PET_NNODES is not set"),
    ("PET_MASTER_ADDR", None, "P2PCOLL_RENDEZVOUS"),
])
def test_bad_trainjob_values(var: str, value: str | None, allowed: str) -> None:
    env = {k: v for k, v in TRAINJOB.items() if k != var}
    if value is not None:
        env[var] = value
    with pytest.raises(SettingsError, match=f"\\${var}") as caught:
        resolve(env)
    assert allowed in str(caught.value)


def test_trainjob_given_a_group_by_the_caller_takes_no_url_from_it() -> None:
    assert resolve(TRAINJOB, world_size=2, rank=0) == (None, 2, 0)
    assert resolve({**TRAINJOB, "P2PCOLL_RENDEZVOUS": "tcp://x:1"}) == ("tcp://x:1", 3, 1)


# --- JobSet and Indexed Job ----------------------------------------------------------------

# Pod 2 of the one Job of replicatedJob "peer" of JobSet "train", its name passed by the
# downward API (JobSet sets no variable of its own).
JOBSET = {"JOBSET_NAME": "train", "HOSTNAME": "train-peer-0-2", "JOB_COMPLETION_INDEX": "2",
          "WORLD_SIZE": "4", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
INDEXED = {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "digits-2", "WORLD_SIZE": "4",
           "KUBERNETES_SERVICE_HOST": "10.96.0.1"}


def test_jobset() -> None:
    assert resolve(JOBSET) == ("tcp://train-peer-0-0.train:29500", 4, 2)
    assert launchers.detect(JOBSET).launcher == "jobset"
    # Names with dashes: the JobSet's name is known, the rest is the replicatedJob's.
    env = {**JOBSET, "JOBSET_NAME": "my-run", "HOSTNAME": "my-run-p2p-peer-0-2"}
    assert resolve(env)[0] == "tcp://my-run-p2p-peer-0-0.my-run:29500"
    assert resolve({**JOBSET, "P2PCOLL_RENDEZVOUS": "tcp://x:1"})[0] == "tcp://x:1"


def test_jobset_says_what_is_wrong() -> None:
    with pytest.raises(SettingsError, match=r"in Job 1 of replicatedJob peer.*replicas: 1"):
        resolve({**JOBSET, "HOSTNAME": "train-peer-1-2"})
    with pytest.raises(SettingsError, match=r"\$JOBSET_NAME=train is set, but this pod "
                                            r"\(hostname other-peer-0-2"):
        resolve({**JOBSET, "HOSTNAME": "other-peer-0-2"})
    with pytest.raises(SettingsError, match=r"JOB_COMPLETION_INDEX=3"):
        resolve({**JOBSET, "JOB_COMPLETION_INDEX": "3"})  # not this pod's index
    with pytest.raises(SettingsError, match=r"\$JOB_COMPLETION_INDEX='x'"):
        resolve({**JOBSET, "JOB_COMPLETION_INDEX": "x"})
    no_size = {k: v for k, v in JOBSET.items() if k != "WORLD_SIZE"}
    with pytest.raises(SettingsError, match="set WORLD_SIZE to the Job's completions"):
        resolve(no_size)
    assert resolve(no_size, world_size=4)[1:] == (4, 2)


def test_indexed_job() -> None:
    env = {**INDEXED, "P2PCOLL_RENDEZVOUS": "tcp://digits-0.peers:29500"}
    assert resolve(env) == ("tcp://digits-0.peers:29500", 4, 2)
    assert launchers.detect(env).launcher == "indexed-job"
    with pytest.raises(SettingsError, match=r"set P2PCOLL_RENDEZVOUS=tcp://digits-0\.SERVICE"):
        resolve(INDEXED)
    # Without a subdomain the hostname is the pod's generated name: no Job name to offer.
    with pytest.raises(SettingsError, match=r"P2PCOLL_RENDEZVOUS=tcp://JOB-0\.SERVICE"):
        resolve({**INDEXED, "HOSTNAME": "digits-2-x7k2p"})
    no_size = {k: v for k, v in env.items() if k != "WORLD_SIZE"}
    with pytest.raises(SettingsError, match="set WORLD_SIZE to the Job's completions"):
        resolve(no_size)
    with pytest.raises(SettingsError, match=r"\$JOB_COMPLETION_INDEX='-1'"):
        resolve({**env, "JOB_COMPLETION_INDEX": "-1"})
    # An elastic group takes no rank from the index.
    assert resolve(env, min_world_size=2)[2] is None


@pytest.mark.parametrize(("layers", "launcher"), [
    ((POD, INDEXED, JOBSET, TRAINJOB), "kubeflow"),
    ((POD, INDEXED, JOBSET), "jobset"),
    ((POD, INDEXED), "indexed-job"),  # a StatefulSet sets no JOB_COMPLETION_INDEX
    ((POD, INDEXED, JOBSET, TRAINJOB, SRUN), "slurm"),
    ((POD, INDEXED, JOBSET, TRAINJOB, {"RANK": "3", "WORLD_SIZE": "5"}), "env"),
])
def test_kubernetes_precedence(layers: tuple[dict[str, str], ...], launcher: str) -> None:
    env: dict[str, str] = {}
    for layer in layers:
        env.update(layer)
    assert launchers.detect(env).launcher == launcher


# --- a rank without a world size; a group of one that nothing asked for --------------------

@pytest.mark.parametrize(("env", "rank", "size"), [
    ({"RANK": "1"}, "RANK", "WORLD_SIZE"),
    ({"RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "7"}, "RANK", "WORLD_SIZE"),
    ({"SLURM_PROCID": "1"}, "SLURM_PROCID", "SLURM_NTASKS"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
])
def test_a_rank_without_a_world_size_is_an_error(env: dict[str, str], rank: str,
                                                   size: str) -> None:
    with pytest.raises(SettingsError) as caught:
        resolve(env)
    message = str(caught.value)
    assert f"${rank}=1 gives this process's rank" in message and f"set {size} too" in message
    assert caught.value.name == f"${size}"  # type: ignore[attr-defined]
    assert resolve(env, world_size=2)[1:] == (2, 1)  # given as an argument: fine
    assert resolve(env, min_world_size=1)[1] is None  # elastic: sizes come and go


async def test_a_group_of_one_nothing_asked_for_warns_naming_what_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import p2pcoll

    for name in list(os.environ):
        if name in FOREIGN or name.startswith(FOREIGN_PREFIXES):
            monkeypatch.delenv(name)
    with pytest.warns(UserWarning, match=r"no world_size= argument, no rendezvous, and no "
                                         r"launcher's variables: WORLD_SIZE") as caught:
        async with p2pcoll.join() as g:
            assert (g.rank, g.world_size) == (0, 1)
    assert len(caught) == 1 and "Pass world_size=1 if that is meant" in str(caught[0].message)
    # Said to be meant: silent (warnings are errors in this suite).
    async with p2pcoll.join(world_size=1) as g:
        assert g.world_size == 1


@pytest.mark.processes
def test_the_group_of_one_warning_comes_once_per_process() -> None:
    script = textwrap.dedent("""
        import asyncio, p2pcoll
        async def main():
            for _ in range(3):
                async with p2pcoll.join() as g:
                    assert g.world_size == 1
            async with p2pcoll.join(world_size=1):
                pass
            print("done")
        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    assert done.stderr.count("UserWarning: p2pcoll.join(): nothing says how many peers") == 1, \
        done.stderr


# --- precedence ----------------------------------------------------------------------------

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "RANK": "0", "WORLD_SIZE": "2",
            "MASTER_ADDR": "m", "MASTER_PORT": "29400"}


@pytest.mark.parametrize(("layers", "want"), [
    ((SRUN, MPIRUN_ENV, TORCHRUN), ("torch://m:29400", 2, 0)),  # torchrun over the others
    ((POD_NO_SIZE, SRUN, MPIRUN_ENV), (resolve(MPIRUN_ENV)[0], 3, 2)),  # Open MPI first
    ((POD_NO_SIZE, SRUN), (resolve(SRUN)[0], 4, 1)),                     # SLURM over k8s
    ((POD, SRUN), (resolve(SRUN)[0], 4, 1)),
    ((SRUN, {"WORLD_SIZE": "9"}), (resolve(SRUN)[0], 9, 1)),  # torch's variables, per field
    ((POD, {"P2PCOLL_RENDEZVOUS": "tcp://x:1"}), ("tcp://x:1", 4, 2)),
    ((TORCHRUN, {"P2PCOLL_RENDEZVOUS": "tcp://x:1"}), ("tcp://x:1", 2, 0)),
    (({},), (None, None, None)),
])
def test_precedence(layers: tuple[dict[str, str], ...], want: tuple[Any, ...]) -> None:
    env: dict[str, str] = {}
    for layer in layers:
        env.update(layer)
    assert resolve(env) == want
    assert resolve(env, rendezvous="tcp://arg:1", world_size=8, rank=7) == ("tcp://arg:1", 8, 7)


def test_rank_not_below_the_world_size_is_the_pinned_rendezvous_error() -> None:
    """Each value is fine alone: join() raises the RendezvousError at once (test_settings)."""
    assert resolve({**SRUN, "SLURM_PROCID": "4"})[1:] == (4, 4)


# --- real runs -----------------------------------------------------------------------------

def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in FOREIGN and not k.startswith(FOREIGN_PREFIXES)}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_three(envs: list[dict[str, str]], *command: str) -> list[str]:
    """Start a process per environment, as a launcher would; returns their outputs."""
    procs = [subprocess.Popen([sys.executable, *command], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for env in envs]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def free_slurm_job_id() -> int:
    """A job id whose derived port (20000 + id % 10000) is free here now."""
    for _ in range(100):
        port = 20000 + int.from_bytes(os.urandom(2), "big") % 10000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 4_000_000 + port - 20000
    raise AssertionError("no free port in 20000..29999")


@pytest.mark.processes
def test_srun_like_run_needs_no_p2pcoll_variable() -> None:
    job = free_slurm_job_id()
    envs = [clean_env(SLURM_PROCID=str(r), SLURM_NTASKS="3", SLURM_JOB_ID=str(job),
                      SLURM_STEP_ID="0", SLURM_STEP_NODELIST="localhost",
                      SLURM_JOB_NODELIST="localhost") for r in range(3)]
    outs = run_three(envs, DEMO)
    assert PASSED in outs[0]
    for r, out in enumerate(outs):
        assert f"rank {r} of 3 joined" in out


@pytest.mark.processes
def test_statefulset_like_run() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    envs = [clean_env(HOSTNAME=f"p2pcoll-{r}", KUBERNETES_SERVICE_HOST="10.96.0.1",
                      WORLD_SIZE="3", P2PCOLL_RENDEZVOUS=url) for r in (2, 0, 1)]
    outs = run_three(envs, DEMO)
    assert PASSED in outs[1]
    for r, out in zip((2, 0, 1), outs, strict=True):
        assert f"rank {r} of 3 joined" in out


@pytest.mark.processes
def test_trainjob_like_run() -> None:
    """Three processes with what Kubeflow's torch runtime gives three nodes (no torchrun)."""
    port = free_port()
    envs = [clean_env(PET_NNODES="3", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(r),
                      PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port),
                      JOB_COMPLETION_INDEX=str(r), KUBERNETES_SERVICE_HOST="10.96.0.1",
                      HOSTNAME=f"tj-node-0-{r}") for r in (1, 2, 0)]
    outs = run_three(envs, DEMO)
    assert PASSED in outs[2]
    for r, out in zip((1, 2, 0), outs, strict=True):
        assert f"rank {r} of 3 joined" in out
        assert "UserWarning" not in out


@pytest.mark.processes
def test_indexed_job_like_run() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    envs = [clean_env(JOB_COMPLETION_INDEX=str(r), HOSTNAME=f"digits-{r}", WORLD_SIZE="3",
                      KUBERNETES_SERVICE_HOST="10.96.0.1", P2PCOLL_RENDEZVOUS=url)
            for r in (0, 2, 1)]
    outs = run_three(envs, DEMO)
    assert PASSED in outs[0]
    for r, out in zip((0, 2, 1), outs, strict=True):
        assert f"rank {r} of 3 joined" in out


def mpirun(*command: str, n: int = 3, **env: str) -> subprocess.CompletedProcess[str]:
    if MPIRUN is None:
        if os.environ.get("CI") == "true":
            pytest.fail("mpirun is missing: CI installs it with the dev extra (p2pcoll[mpi])")
        pytest.skip("mpirun not installed: pip install 'p2pcoll[mpi]'")
    full = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **env)
    return subprocess.run(
        [MPIRUN, "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable,
         *command], env=full, cwd=ROOT, capture_output=True, text=True, timeout=120,
        check=False)


@pytest.mark.processes
def test_mpirun_runs_the_demo_with_no_p2pcoll_variable() -> None:
    done = mpirun(DEMO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert PASSED in done.stdout


THROUGH_MPI = """
    import asyncio, os
    from mpi4py import MPI  # the program's own MPI: p2pcoll may use it, never starts it
    import numpy as np, p2pcoll
    os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"] = "1"  # as if every rank had a node of its own
    async def main():
        async with p2pcoll.join() as g:
            total = await g.allreduce(np.array([g.rank + 1.0]))
            os.write(1, f"RANK {g.rank} {g.settings.rendezvous} {total[0]}\\n".encode())
    asyncio.run(main())
"""


@pytest.mark.processes
def test_mpirun_on_several_nodes_meets_through_mpi(tmp_path: Path) -> None:
    script = tmp_path / "through_mpi.py"
    script.write_text(textwrap.dedent(THROUGH_MPI))
    done = mpirun(str(script))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RANK"))
    url = f"tcp://{socket.gethostname()}:"
    assert [line.split()[0:2] for line in lines] == [["RANK", str(r)] for r in range(3)]
    assert all(line.split()[2].startswith(url) and line.endswith(" 6.0") for line in lines)
    assert len({line.split()[2] for line in lines}) == 1


def test_module_is_documented() -> None:
    doc = launchers.__doc__ or ""
    for row in ("torchrun", "Open MPI", "SLURM", "Kubernetes", "20000 + SLURM_JOB_ID % 10000",
                "Kubeflow TrainJob", "JobSet", "Indexed Job", "StatefulSet", "PET_NODE_RANK",
                "JOB_COMPLETION_INDEX", "warns once"):
        assert row in doc
