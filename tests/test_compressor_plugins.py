"""DiLoCo's ``compressor=``: a name from the ``p2pcoll.compressors`` entry points (the one
plugin table strategies and codecs use) or an object implementing the Compressor protocol;
unknown names and broken plugins are refused by name, and a plugin's compressor trains with
bit-identical replicas over real peers (memory groups)."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import memory_groups
from p2pcoll.training import compressors
from p2pcoll.training.compressors import Compressor, TopK2Bit

if TYPE_CHECKING:
    from p2pcoll import Group

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 10.0


class Halves(Compressor):
    """A plugin's compressor: the pseudo-gradients in float16, averaged by an allreduce."""

    name = "halves"

    def __init__(self, density: float | None = None) -> None:
        self.density = density

    @property
    def settings(self) -> dict[str, Any]:
        return {"compressor": self.name, "density": self.density}

    def message_bytes(self, sizes: Sequence[int], world_size: int) -> int:
        return 2 * sum(sizes)

    async def average(self, group: Group, deltas: Sequence[np.ndarray],
                      residuals: Sequence[np.ndarray] | None, *, names: Sequence[str],
                      round_no: int, nonfinite: str, strategy: str | None,
                      timeout: float | None) -> list[np.ndarray]:
        out = []
        for d in deltas:
            summed = await group.allreduce(d.astype(np.float16), "sum", timeout=timeout)
            out.append(summed.astype(d.dtype) / d.dtype.type(group.world_size))
        return out


class Unmakeable(Halves):
    name = "unmakeable"

    def __init__(self, density: float | None = None) -> None:
        raise RuntimeError("needs a GPU")


@dataclass
class FakeEntryPoint:
    name: str
    value: str
    target: Any
    dist: Any = None
    group: str = compressors.ENTRY_POINT_GROUP

    def load(self) -> Any:
        return self.target


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh table that sees the real entry points plus three fakes."""
    real = list(entry_points(group=compressors.ENTRY_POINT_GROUP))
    fakes = [FakeEntryPoint("halves", "acme:Halves", Halves),
             FakeEntryPoint("unmakeable", "acme:Unmakeable", Unmakeable),
             FakeEntryPoint("notone", "acme:notone", len)]

    def scan(*, group: str) -> list[Any]:
        assert group == compressors.ENTRY_POINT_GROUP
        return [*real, *fakes]

    monkeypatch.setattr(compressors, "entry_points", scan)
    monkeypatch.setattr(compressors, "COMPRESSORS", compressors.compressor_table())


async def on_groups(n: int, fn: Any) -> list[Any]:
    groups = await memory_groups(n)
    try:
        return list(await asyncio.gather(*(fn(g) for g in groups)))
    finally:
        for g in groups:
            await g.close()


def test_topk2bit_is_declared_as_an_entry_point() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = table["project"]["entry-points"]["p2pcoll.compressors"]
    assert declared == {"topk2bit": "p2pcoll.training.compressors:TopK2Bit"}
    entry = compressors.compressor_table().entries()["topk2bit"]
    assert entry.value is TopK2Bit and "built-in" in entry.origin


def test_a_plugin_is_found_by_name_and_made_at_the_density(plugins: None) -> None:
    made = compressors.make_compressor("halves", 0.25)
    assert isinstance(made, Halves) and made.density == 0.25
    assert isinstance(compressors.make_compressor("topk2bit", None), TopK2Bit)


def test_unknown_and_broken_names_are_refused_by_name(plugins: None) -> None:
    with pytest.raises(ValueError, match=r"unknown compressor 'topk9bit'; known: 'halves', "
                                         r"'topk2bit'$"):
        compressors.make_compressor("topk9bit", None)
    with pytest.raises(p2pcoll.PluginValidationError,
                       match=r"'unmakeable'.*Unmakeable\(\) raised RuntimeError: needs a GPU"):
        compressors.make_compressor("unmakeable", None)
    with pytest.raises(p2pcoll.PluginValidationError, match="not a .*Compressor subclass"):
        compressors.make_compressor("notone", None)


async def test_diloco_trains_with_a_plugins_compressor_and_replicas_stay_equal(
        plugins: None) -> None:
    async def rank(group: p2pcoll.Group) -> bytes:
        params = {"w": np.zeros((8, 4), np.float32)}
        diloco = training.DiLoCo(group, params, inner_steps=2, compressor="halves",
                                 timeout=TIMEOUT)
        for step in range(6):
            params["w"] -= np.float32(0.25 * (group.rank + 1) + step)
            await diloco.after_inner_step()
        assert diloco.outer_steps == 3
        assert diloco.traffic.sent_bytes == 3 * 2 * 32
        return diloco.anchor[0].tobytes()

    got = await on_groups(3, rank)
    assert got[0] == got[1] == got[2]
    assert np.frombuffer(got[0], np.float32).any()


async def test_an_object_is_taken_as_it_is_and_its_settings_are_agreed() -> None:
    async def rank(group: p2pcoll.Group) -> Exception | None:
        params = {"w": np.zeros(4)}
        diloco = training.DiLoCo(group, params, inner_steps=1,
                                 compressor=Halves(0.5 if group.rank else None),
                                 timeout=TIMEOUT)
        assert isinstance(diloco.compressor, Halves)
        params["w"] -= 1.0
        try:
            await diloco.after_inner_step()
        except p2pcoll.CollectiveMismatch as exc:
            return exc
        return None

    for exc in await on_groups(2, rank):
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "density is None on rank 0 but 0.5 on rank 1" in str(exc), str(exc)


@pytest.mark.parametrize("compressor, density, match", [
    (Halves(), 0.1, "density=0.1 applies to a compressor given by name; Halves has its own"),
    (3.5, None, r"compressor must be a name \('topk2bit'\) or a Compressor, got 3.5"),
    ("topk3bit", None, r"unknown compressor 'topk3bit'; known: 'topk2bit'"),
])
async def test_bad_compressors_are_refused_when_diloco_is_made(
        compressor: Any, density: Any, match: str) -> None:
    async def rank(group: p2pcoll.Group) -> None:
        with pytest.raises(ValueError, match=match):
            training.DiLoCo(group, {"w": np.zeros(4)}, inner_steps=2, compressor=compressor,
                            density=density)
    await on_groups(1, rank)
