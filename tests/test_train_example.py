"""The training examples, end to end: real processes started by ``p2pcoll launch``.

They need the ``examples`` extra (scikit-learn, tqdm, matplotlib); the torch example runs
only where torch is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes


ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 90  # seconds; a run takes a few, mostly importing scikit-learn (and torch)


def launch(n: int, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", str(n), "--",
         sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=cwd,
    )


def check_training_output(out: str, n: int) -> None:
    for rank in range(n):
        m = re.search(rf"^\[{rank}\] rank {rank}: final weights equal single-process training "
                      r"\(max relative difference ([0-9.e+-]+), tolerance 1e-06\)$", out, re.M)
        assert m, f"rank {rank} did not report the comparison:\n{out}"
        assert float(m.group(1)) <= 1e-6
    m = re.search(r"^\[0\] test accuracy: ([0-9.]+)%$", out, re.M)
    assert m and float(m.group(1)) > 80, out
    assert f"[0] replicas identical on all {n} ranks" in out


def test_digits_example_trains_like_one_process(tmp_path: Path) -> None:
    png = tmp_path / "loss.png"
    result = launch(2, "train_digits.py", "--epochs", "2", "--plot", str(png), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    check_training_output(result.stdout, 2)
    assert "round/s" in result.stdout, "rank 0 shows a progress bar"
    assert "[1] " not in result.stdout.replace("[1] rank 1: final weights", ""), (
        "only rank 0 talks, apart from its verdict")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_digits_example_writes_no_plot_when_asked(tmp_path: Path) -> None:
    result = launch(1, "train_digits.py", "--epochs", "1", "--no-plot", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    check_training_output(result.stdout, 1)
    assert list(tmp_path.iterdir()) == []


def test_torch_example_trains_like_one_process(tmp_path: Path) -> None:
    import torch  # noqa: F401  (CI installs the torch extra: this must not skip)
    result = launch(2, "train_torch.py", "--epochs", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    check_training_output(result.stdout, 2)
