"""examples/ray_train.py for real: Ray Train's TorchTrainer with ``TorchConfig(backend=
"p2pcoll")`` on 4 workers of a local Ray (one instance for the module).

- p2pcoll ends with exactly the weights of ``backend="gloo"`` (the same SHA-256).
- A worker killed (SIGKILL) while the others wait for it in DDP's allreduce: ``fit()`` raises
  Ray Train's error naming the dead rank; nothing hangs.
- The same kill with ``max_failures=1``: Ray Train starts the workers again, p2pcoll forms a
  new group, and the run ends with the undisturbed run's weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("ray") is None:  # pragma: no cover - the ray extra is in dev
    if os.environ.get("CI") == "true":
        raise RuntimeError("ray is missing: CI installs it with the dev extra (p2pcoll[ray])")
    pytest.skip("ray not installed: pip install 'p2pcoll[ray]'", allow_module_level=True)

import ray
import ray.train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import ray_train  # noqa: E402  # examples/ray_train.py, once examples/ is on the path

WORKERS = 4
# Ray Train's own modules warn about their own deprecated settings (ray.data's context)
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Any:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1
    ray.init(num_cpus=WORKERS, include_dashboard=False, runtime_env={
        "working_dir": str(EXAMPLES), "excludes": ["*.png", "custom_strategy", "k8s"],
        "env_vars": {"OMP_NUM_THREADS": "1", "P2PCOLL_HEARTBEAT_TIMEOUT": "2"}})
    yield
    ray.shutdown()


def options(tmp_path: Path, **changes: Any) -> argparse.Namespace:
    args = argparse.Namespace(workers=WORKERS, epochs=1, batch=64, storage=str(tmp_path),
                              die_rank=-1, die_step=5, die_once=None, max_failures=0)
    vars(args).update(changes)
    return args


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return ray_train.fit("p2pcoll", options(tmp_path_factory.mktemp("p2pcoll")))


@pytest.mark.timeout(600)
def test_same_weights_as_gloo(undisturbed: dict[str, Any], tmp_path: Path) -> None:
    gloo = ray_train.fit("gloo", options(tmp_path))
    assert undisturbed["identical"] and gloo["identical"]
    assert undisturbed["steps"] == gloo["steps"] == 28
    assert undisturbed["sha256"] == gloo["sha256"]


@pytest.mark.timeout(600)
def test_a_killed_worker_fails_the_run_naming_its_rank(tmp_path: Path) -> None:
    with pytest.raises(ray.train.TrainingFailedError) as caught:
        ray_train.fit("p2pcoll", options(tmp_path, die_rank=2))
    message = str(caught.value)
    assert "Rank 2" in message, message
    assert "died" in message, message


@pytest.mark.timeout(600)
def test_ray_train_restarts_after_a_kill_and_ends_with_the_same_weights(
        undisturbed: dict[str, Any], tmp_path: Path) -> None:
    marker = tmp_path / "died"
    metrics = ray_train.fit("p2pcoll", options(tmp_path, die_rank=1, die_once=str(marker),
                                               max_failures=1))
    assert marker.exists()  # rank 1 did die once
    assert metrics["identical"]
    assert metrics["sha256"] == undisturbed["sha256"]
