"""The container image, for real: built with podman, four peer containers train the digits
classifier together and answer their health checks; the compose and Kubernetes examples agree
with the Dockerfile.

The image tests need podman (rootful) and the local base image that ``.ci/container-setup``
makes (no public image registry is reachable here). Where they are missing these tests skip,
saying so, except under CI (``CI=true``), where they fail: CI must test the image. They are
marked ``container``: ``pytest -m "not container"`` leaves them out. The tests of the compose
and Kubernetes files need only PyYAML (CI installs it; elsewhere they skip without it).

The containers use the host's network (``--network host``) and talk over 127.0.0.1 only. Each
gets a hostname of its own, as under compose or Kubernetes; with the host's name (podman's
default with ``--network host``) every container would claim the host's identity (hostname
and boot id), and the ``auto`` transport would try ipc sockets in /tmp directories that the
containers do not share.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2pcoll.testing import free_port

pytestmark = pytest.mark.slow

# The tests that build and run the image (the others only read files).
container = pytest.mark.container

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = "localhost/p2pcoll-base"
IMAGE = "localhost/p2pcoll-test"
KEY_IN_CONTAINER = "/run/secrets/p2pcoll-job-key"
BUILD_TIMEOUT = 1200  # seconds; a first build downloads the dependencies (two minutes here)
TEST_TIMEOUT = BUILD_TIMEOUT + 300
RUN_TIMEOUT = 180  # from `podman run` to every peer's exit
HOLD_SECONDS = 15  # the job stays in its group, ready, this long after training
DIGEST = re.compile(r"test accuracy ([0-9.]+)%; weights digest ([0-9a-f]{16})")


def unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail under CI, which must test the image for real."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the image must be tested; run .ci/container-setup)")
    pytest.skip(reason)


def podman(*args: str, timeout: float = 60, check: bool = True
           ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], check=False, capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout}{result.stderr}")
    return result


def pip_index_conf() -> str:
    """A pip.conf naming the package index (and extra indexes) that pip uses on this host, for
    the build; "" where pip uses its defaults. Only http(s) indexes are passed on: the host's
    paths (file:// indexes, find-links, certificates, constraints) mean nothing in the build,
    whose base image has the host's CA certificates already."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             check=True, capture_output=True, text=True, timeout=60).stdout
    values: dict[str, list[str]] = {}
    for line in listing.splitlines():  # global.index-url='...', :env:.extra-index-url='...'
        m = re.fullmatch(r"[^.]*\.(index-url|extra-index-url|trusted-host)='(.*)'", line)
        if m:
            values.setdefault(m.group(1), []).extend(m.group(2).split())
    urls = {key: [v for v in vs if re.match(r"https?://", v) or key == "trusted-host"]
            for key, vs in values.items()}
    lines = [f"{key} = {' '.join(vs)}" for key, vs in urls.items() if vs]
    return "[global]\n" + "\n".join(lines) + "\n" if lines else ""


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The image built from the repository's Dockerfile on the local base image."""
    if shutil.which("podman") is None:
        unavailable("podman is not installed (.ci/container-setup installs it)")
    if os.geteuid() != 0:
        unavailable("the container tests use rootful podman: run them as root, as CI does")
    if podman("image", "exists", BASE_IMAGE, check=False).returncode != 0:
        unavailable(f"no base image {BASE_IMAGE} (.ci/container-setup makes it)")
    build = ["build", "--format", "docker", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
             "-t", IMAGE]
    conf = pip_index_conf()
    if conf:  # a build secret: in no layer of the image
        path = tmp_path_factory.mktemp("pip") / "pip.conf"
        path.write_text(conf)
        build += ["--secret", f"id=pip.conf,src={path}"]
    started = time.monotonic()
    podman(*build, str(ROOT), timeout=BUILD_TIMEOUT)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    print(f"\nbuilt {IMAGE} in {time.monotonic() - started:.0f}s: {size / 1e6:.0f} MB")
    yield IMAGE


def free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def job_key(directory: Path, name: str, image: str) -> Path:
    """A new job key file, owned by the image's user (it is mounted read-only)."""
    path = directory / name
    subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(path)], check=True,
                   capture_output=True, timeout=60)
    user = podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    uid, _, gid = user.partition(":")
    os.chown(path, int(uid), int(gid or uid))
    return path


class Peers:
    """Peer containers of one test, all removed at the end, whatever happened."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.names: list[str] = []
        self.prefix = f"p2pcoll-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"

    def run(self, index: int, key: Path, metrics_port: int, **env: str) -> str:
        name = f"{self.prefix}-{index}"
        self.names.append(name)
        env = {"P2PCOLL_HOST": "127.0.0.1", "P2PCOLL_METRICS_HOST": "127.0.0.1",
               "P2PCOLL_METRICS_PORT": str(metrics_port), "P2PCOLL_KEY_FILE": KEY_IN_CONTAINER,
               **env}
        podman("run", "-d", "--name", name, "--hostname", f"p2pcoll-{index}",
               "--network", "host", "--volume", f"{key}:{KEY_IN_CONTAINER}:ro",
               *(f"--env={k}={v}" for k, v in env.items()), self.image)
        return name

    def logs(self, name: str) -> str:
        result = podman("logs", name, check=False)
        return result.stdout + result.stderr

    def all_logs(self) -> str:
        return "\n".join(f"--- {name}:\n{self.logs(name)}" for name in self.names)

    def wait(self, name: str, timeout: float) -> int:
        return int(podman("wait", name, timeout=timeout).stdout.strip())

    def healthy(self, name: str) -> bool:
        """`podman healthcheck run`: the image's HEALTHCHECK, run now."""
        return podman("healthcheck", "run", name, check=False).returncode == 0

    def remove(self) -> None:
        if self.names:
            podman("rm", "--force", "--time", "0", *self.names, check=False, timeout=120)


@pytest.fixture
def peers(image: str) -> Iterator[Peers]:
    p = Peers(image)
    try:
        yield p
    finally:
        p.remove()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


@container
@pytest.mark.timeout(TEST_TIMEOUT)
def test_four_containers_train_digits_together(peers: Peers, tmp_path: Path) -> None:
    started = time.monotonic()
    key = job_key(tmp_path, "job.key", peers.image)
    rendezvous, *metrics = free_ports(5)
    names = [peers.run(rank, key, metrics[rank], RANK=str(rank), WORLD_SIZE="4",
                       P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{rendezvous}",
                       DIGITS_HOLD_SECONDS=str(HOLD_SECONDS))
             for rank in range(4)]

    # Trained: every peer has logged its digest, and holds the group for HOLD_SECONDS.
    deadline = time.monotonic() + RUN_TIMEOUT
    found: dict[str, tuple[float, str]] = {}
    while len(found) < 4:
        for name in names:
            m = DIGEST.search(peers.logs(name)) if name not in found else None
            if m:
                found[name] = float(m.group(1)), m.group(2)
        running = podman("ps", "--filter", f"name={peers.prefix}", "--format", "{{.Names}}")
        assert len(found) == 4 or len(running.stdout.split()) == 4, (
            f"a peer exited before training: {found}\n{peers.all_logs()}")
        assert time.monotonic() < deadline, f"not trained in {RUN_TIMEOUT}s:\n{peers.all_logs()}"
        time.sleep(0.5)
    trained = time.monotonic()

    # Ready, while they hold: the image's health check (liveness), /readyz and /metrics.
    for rank, name in enumerate(names):
        assert peers.healthy(name), f"{name} unhealthy:\n{peers.logs(name)}"
        status, body = get(metrics[rank], "/readyz")
        health = json.loads(body)
        assert status == 200, body
        assert (health["state"], health["rank"], health["world_size"]) == ("ready", rank, 4)
        status, text = get(metrics[rank], "/metrics")
        assert status == 200 and "p2pcoll_world_size 4.0" in text, text
    assert time.monotonic() - trained < HOLD_SECONDS, "checked too late to prove anything"

    codes = [peers.wait(name, timeout=RUN_TIMEOUT) for name in names]
    assert codes == [0, 0, 0, 0], peers.all_logs()
    accuracies, digests = zip(*found.values(), strict=True)
    assert len(set(digests)) == 1, f"the replicas differ: {found}"
    assert min(accuracies) > 80, found
    print(f"\n4 containers trained digits ({accuracies[0]:.1f}%, digest {digests[0]}) in "
          f"{time.monotonic() - started:.0f}s, {HOLD_SECONDS}s of it holding")


@container
@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_container_with_another_key_is_refused(peers: Peers, tmp_path: Path) -> None:
    key = job_key(tmp_path, "job.key", peers.image)
    other = job_key(tmp_path, "other.key", peers.image)
    rendezvous, *metrics = free_ports(3)
    env = {"WORLD_SIZE": "2", "P2PCOLL_RENDEZVOUS": f"tcp://127.0.0.1:{rendezvous}",
           "P2PCOLL_JOIN_TIMEOUT": "60"}
    host = peers.run(0, key, metrics[0], RANK="0", **env)
    deadline = time.monotonic() + RUN_TIMEOUT
    while get_or_none(metrics[0]) is None:  # rank 0 is up (and hosts the rendezvous)
        assert time.monotonic() < deadline, peers.all_logs()
        time.sleep(0.5)
    intruder = peers.run(1, other, metrics[1], RANK="1", **env)

    assert peers.wait(intruder, timeout=RUN_TIMEOUT) != 0, peers.all_logs()
    log = peers.logs(intruder)
    assert "RendezvousError: the handshake with the rendezvous" in log, log
    # The group never formed: rank 0 is alive (the image's health check is liveness) but
    # not ready, and says so.
    assert peers.healthy(host), peers.logs(host)
    status, body = get(metrics[0], "/readyz")
    assert (status, json.loads(body)["state"]) == (503, "forming"), peers.logs(host)


def get_or_none(port: int) -> tuple[int, str] | None:
    try:
        return get(port, "/healthz")
    except OSError:
        return None


# --- the examples agree with the Dockerfile --------------------------------------------------


def dockerfile() -> dict[str, Any]:
    """What the image promises: its CMD, exposed ports, metrics port and user."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    cmd = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    expose = re.search(r"^EXPOSE (.*)$", text, re.MULTILINE)
    metrics = re.search(r"^ENV P2PCOLL_METRICS_PORT=(\d+)$", text, re.MULTILINE)
    user = re.search(r"^USER (\d+)(?::(\d+))?$", text, re.MULTILINE)
    assert cmd and expose and metrics and user, "the Dockerfile lost a line these tests read"
    return {"cmd": json.loads(cmd.group(1)), "ports": [int(p) for p in expose.group(1).split()],
            "metrics_port": int(metrics.group(1)), "uid": int(user.group(1))}


def load_yaml(path: Path) -> list[Any]:
    try:
        import yaml
    except ImportError:
        unavailable("PyYAML is not installed: the compose and Kubernetes files go unchecked")
    with path.open() as f:
        return list(yaml.safe_load_all(f))


def test_compose_file_runs_the_images_job() -> None:
    image = dockerfile()
    (compose,) = load_yaml(ROOT / "examples" / "compose.yaml")
    services = compose["services"]
    ranks = {int(s["environment"]["RANK"]): name for name, s in services.items()}
    assert sorted(ranks) == list(range(len(services)))
    for s in services.values():
        env = s["environment"]
        assert int(env["WORLD_SIZE"]) == len(services)
        assert env["P2PCOLL_RENDEZVOUS"] == f"tcp://{ranks[0]}:{image['ports'][0]}"
        assert (ROOT / "examples" / s["build"]["context"] / "Dockerfile").resolve() == (
            ROOT / "Dockerfile")
        assert s.get("command", image["cmd"]) == image["cmd"]
        assert "healthcheck" not in s, "the image's own HEALTHCHECK is the one to use"
        assert [p.rsplit(":", 1)[1] for p in s["ports"]] == [str(image["metrics_port"])]
        (secret,) = s["secrets"]
        assert env["P2PCOLL_KEY_FILE"] == f"/run/secrets/{secret}"
        assert secret in compose["secrets"]
    assert len({s["image"] for s in services.values()}) == 1


# The Kubernetes manifests are checked against the Dockerfile in tests/test_k8s_manifests.py.
