"""The Kubernetes examples (examples/k8s/: a StatefulSet with its Service, a Kubeflow
TrainJob with its TrainingRuntime, a JobSet) agree with the image the Dockerfile builds
(entrypoint and command, ports, metrics port, user, the job key's mount) and with p2pcoll
itself: each pod's environment, as its controller completes it (the hostname, Kubeflow's
``PET_*``, ``JOB_COMPLETION_INDEX``), resolves to the right rank, world size and rendezvous
with no variable the manifest does not set. Readiness is ``/readyz``, liveness ``/healthz``,
and the image's own ``HEALTHCHECK`` stays on ``/healthz``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2pcoll.errors import SettingsError
from p2pcoll.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "examples" / "k8s"
KUBEFLOW_PORT = 29500  # Kubeflow Trainer's ContainerTrainerPort, its PET_MASTER_PORT


def dockerfile() -> dict[str, Any]:
    """What the image promises: entrypoint, command, exposed ports, metrics port, user and
    the path its HEALTHCHECK reads."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")

    def line(pattern: str) -> re.Match[str]:
        m = re.search(pattern, text, re.MULTILINE)
        assert m, f"the Dockerfile has no line like {pattern!r}"
        return m

    health = line(r"^HEALTHCHECK .*CMD (\[.*\])$")
    return {
        "entrypoint": json.loads(line(r"^ENTRYPOINT (\[.*\])$").group(1)),
        "cmd": json.loads(line(r"^CMD (\[.*\])$").group(1)),
        "ports": [int(p) for p in line(r"^EXPOSE (.*)$").group(1).split()],
        "metrics_port": int(line(r"^ENV P2PCOLL_METRICS_PORT=(\d+)$").group(1)),
        "uid": int(line(r"^USER (\d+)(?::(\d+))?$").group(1)),
        "healthcheck": re.search(r"/(\w+)'", health.group(1)).group(1),  # type: ignore[union-attr]
    }


IMAGE = dockerfile()
RENDEZVOUS_PORT = IMAGE["ports"][0]


def documents() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every document of examples/k8s/*.yaml by kind, with the file it is in."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in found, f"two {doc['kind']}s"
            found[doc["kind"]] = (path.name, doc)
    return found


DOCS = documents()


def doc(kind: str) -> dict[str, Any]:
    return DOCS[kind][1]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's plain values (valueFrom entries are checked where they matter)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def resolve(env: dict[str, str]) -> tuple[str | None, int | None, int | None]:
    """What join() would make of this pod's environment (the key file is checked apart:
    it exists only in the pod)."""
    s = Settings.resolve({k: v for k, v in env.items() if k != "P2PCOLL_KEY_FILE"})
    return s.rendezvous, s.world_size, s.rank


def check_pod(pod: dict[str, Any], container: dict[str, Any]) -> None:
    """What every peer's pod template owes the image (see the module docstring)."""
    (compose,) = yaml.safe_load_all((ROOT / "examples" / "compose.yaml").read_text())
    assert {container["image"]} == {s["image"] for s in compose["services"].values()}
    assert "command" not in container, "the image's ENTRYPOINT is p2pcoll"
    assert IMAGE["entrypoint"] == ["p2pcoll"]
    assert container["args"] == IMAGE["cmd"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert sorted(ports.values()) == sorted(IMAGE["ports"])
    assert ports["rendezvous"] == RENDEZVOUS_PORT
    env = env_of(container)
    assert int(env["P2PCOLL_METRICS_PORT"]) == IMAGE["metrics_port"] == ports["metrics"]
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert ports.get(get["port"], get["port"]) == IMAGE["metrics_port"], probe
    security = pod["securityContext"]
    assert security["runAsUser"] == IMAGE["uid"] and security["runAsNonRoot"] is True
    (volume,) = pod["volumes"]
    # Readable by the pod's group (fsGroup) and nobody else: p2pcoll refuses a key the
    # world can read.
    assert volume["secret"]["defaultMode"] == 0o440 and "fsGroup" in security
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert Path(env["P2PCOLL_KEY_FILE"]).parent == Path(mount["mountPath"])
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_examples_are_the_ones_described() -> None:
    assert sorted(DOCS) == ["JobSet", "Service", "StatefulSet", "TrainJob", "TrainingRuntime"]
    # Each runs the same job its own way: each file says to apply itself, never the folder.
    for name in {file for file, _ in DOCS.values()} - {"service.yaml"}:
        applies = re.findall(r"kubectl apply (.*)", (K8S / name).read_text())
        assert [line.split() for line in applies] == [
            ["-f", "examples/k8s/service.yaml", "-f", "examples/k8s/statefulset.yaml"]
            if name == "statefulset.yaml" else ["-f", f"examples/k8s/{name}"]], applies


def test_the_images_health_check_is_liveness() -> None:
    assert IMAGE["healthcheck"] == "healthz"


# --- StatefulSet -----------------------------------------------------------------------------


def test_statefulset() -> None:
    service, sts = doc("Service"), doc("StatefulSet")
    assert service["spec"]["clusterIP"] == "None"
    # Ready (/readyz) only once the group has formed, which needs the names first.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert sorted(p["port"] for p in service["spec"]["ports"]) == sorted(IMAGE["ports"])
    spec = sts["spec"]
    assert spec["serviceName"] == service["metadata"]["name"]
    assert spec["podManagementPolicy"] == "Parallel"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    check_pod(pod, container)
    env = env_of(container)
    assert "RANK" not in env, "the rank comes from the pod's hostname"
    name, svc = sts["metadata"]["name"], service["metadata"]["name"]
    url = f"tcp://{name}-0.{svc}:{RENDEZVOUS_PORT}"
    for ordinal in range(spec["replicas"]):
        pod_env = {**env, "HOSTNAME": f"{name}-{ordinal}", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
        assert resolve(pod_env) == (url, spec["replicas"], ordinal)


# --- Kubeflow TrainJob -----------------------------------------------------------------------


def kubeflow_env(trainjob: dict[str, Any], runtime: dict[str, Any], node: int) -> dict[str, str]:
    """What Kubeflow Trainer's torch plugin adds to node ``node``'s trainer container
    (pkg/runtime/framework/plugins/torch/torch.go), and the hostname JobSet gives it."""
    name = trainjob["metadata"]["name"]
    trainer = trainjob["spec"]["trainer"]
    return {
        "PET_NNODES": str(trainer.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": str(node),  # the pod's job-completion-index annotation
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": str(KUBEFLOW_PORT),
        "JOB_COMPLETION_INDEX": str(node),
        "HOSTNAME": f"{name}-node-0-{node}",
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    }


def test_trainjob() -> None:
    trainjob, runtime = doc("TrainJob"), doc("TrainingRuntime")
    ref = trainjob["spec"]["runtimeRef"]
    assert (ref["apiGroup"], ref["kind"], ref["name"]) == (
        "trainer.kubeflow.org", "TrainingRuntime", runtime["metadata"]["name"])
    assert "torch" in runtime["spec"]["mlPolicy"]  # the runtime that sets PET_*
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    # Kubeflow fills in the container named "node" of the replicatedJob it marks "trainer".
    assert replicated["name"] == "node"
    assert replicated["template"]["metadata"]["labels"][
        "trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    pod = replicated["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "node"
    check_pod(pod, container)
    env = env_of(container)
    trainer = trainjob["spec"]["trainer"]
    assert not {"RANK", "WORLD_SIZE", "P2PCOLL_RENDEZVOUS", "MASTER_ADDR"} & env.keys()
    assert not [k for k in env if k.startswith("PET_")], "Kubeflow refuses them in a TrainJob"
    assert not trainer.get("env") and "command" not in trainer
    assert trainer["numProcPerNode"] == 1, "one p2pcoll peer per pod"
    assert RENDEZVOUS_PORT == KUBEFLOW_PORT
    nodes = trainer["numNodes"]
    name = trainjob["metadata"]["name"]
    for node in range(nodes):
        pod_env = {**env, **kubeflow_env(trainjob, runtime, node)}
        assert resolve(pod_env) == (f"tcp://{name}-node-0-0.{name}:{KUBEFLOW_PORT}", nodes,
                                    node)


def test_trainjob_with_a_process_per_cpu_is_refused_by_name() -> None:
    trainjob, runtime = doc("TrainJob"), doc("TrainingRuntime")
    pod_env = {**kubeflow_env(trainjob, runtime, 1), "PET_NPROC_PER_NODE": "2"}
    with pytest.raises(SettingsError, match=r"\$PET_NPROC_PER_NODE='2'.*numProcPerNode: 1"):
        resolve(pod_env)


# --- JobSet ----------------------------------------------------------------------------------


def test_jobset() -> None:
    jobset = doc("JobSet")
    name = jobset["metadata"]["name"]
    assert "subdomain" not in jobset["spec"].get("network", {}), \
        "p2pcoll meets under the default subdomain, the JobSet's name"
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert replicated["replicas"] == 1, "the group is one Job: ranks are its pods' indices"
    assert job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    check_pod(pod, container)
    env = env_of(container)
    size = int(env["WORLD_SIZE"])
    assert job["parallelism"] == job["completions"] == size
    assert not {"RANK", "P2PCOLL_RENDEZVOUS"} & env.keys()
    (jobset_name,) = [e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]
                      if e["name"] == "JOBSET_NAME"]
    assert jobset_name == "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    url = f"tcp://{name}-{replicated['name']}-0-0.{name}:{RENDEZVOUS_PORT}"
    for index in range(size):
        pod_env = {**env, "JOBSET_NAME": name, "JOB_COMPLETION_INDEX": str(index),
                   "HOSTNAME": f"{name}-{replicated['name']}-0-{index}",
                   "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
        assert resolve(pod_env) == (url, size, index)
