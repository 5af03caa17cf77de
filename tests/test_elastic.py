"""Elastic training (p2pcoll.training.train_elastic): peers die, peers arrive, rounds go on.

One test runs ``examples/train_elastic.py``'s scenario for real (processes, SIGKILL, a
restarted peer); the others run peers as tasks of this event loop, over real sockets, with
a state that counts how often each round was applied.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import free_port
from conftest import newcomer_arrives

ROOT = Path(__file__).resolve().parents[1]


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("train_elastic",
                                                  ROOT / "examples" / "train_elastic.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_exactly_once(groups: list[dict[str, Any]], rounds: int) -> None:
    """One rank's groups, in order: in each it applied consecutive rounds from where the
    group started, the next group never started before where this one stopped (it started
    later when this rank adopted rounds another rank applied), and the last one ended at
    ``rounds``."""
    for group, after in zip(groups, [*groups[1:], None], strict=True):
        start, applied = group["round"], group["applied"]
        assert applied == list(range(start, start + len(applied))), groups
        stop = start + len(applied)
        if after is None:
            assert stop == rounds and group["ended"] == "finished", groups
        else:
            assert after["round"] >= stop, groups


def as_dicts(result: training.ElasticResult) -> list[dict[str, Any]]:
    return [{"round": f.round, "applied": f.applied, "ended": f.ended,
             "world_size": f.world_size} for f in result.formations]


# --- processes: the example's scenario ------------------------------------------------------


@pytest.mark.processes
def test_a_killed_peer_is_replaced_and_every_replica_ends_identical(tmp_path: Path) -> None:
    example = load_example()
    args = example.parse_args(["--demo", "--epochs", "15", "--die-at", "30"])
    with open(tmp_path / "workers.log", "w") as log:
        reports, victim_code = example.demo(args, stderr=log, timeout=90)
    logs = (tmp_path / "workers.log").read_text()

    assert victim_code == -signal.SIGKILL, logs
    assert len(reports) == args.workers, logs  # three survivors and the replacement
    rounds = reports[0]["rounds"]
    for report in reports:
        check_exactly_once(report["groups"], rounds)
    survivors = [r for r in reports if r["joined_at"] == 0]
    newcomers = [r for r in reports if r["joined_at"] > 0]
    assert len(survivors) == args.workers - 1 and len(newcomers) == 1, reports
    assert newcomers[0]["groups"][0]["world_size"] == args.workers, reports
    for report in survivors:  # they went on without the victim, then took the newcomer in
        sizes = [g["world_size"] for g in report["groups"]]
        assert sizes[0] == args.workers and sizes[-1] == args.workers, reports
        assert any(s < args.workers for s in sizes), reports
        assert "PeerLost" in report["groups"][0]["ended"] or \
            "GroupBroken" in report["groups"][0]["ended"], reports
    assert len({r["digest"] for r in reports}) == 1, reports
    # Every round exactly once: the weights are those of one process training alone.
    for report in reports:
        assert report["difference"] <= example.RTOL, report
        assert report["accuracy"] == pytest.approx(report["accuracy_alone"], abs=0.01)
    assert reports[0]["accuracy"] > 0.9


# --- tasks in this process --------------------------------------------------------------------


class Job:
    """Peers of one elastic job as tasks. The state counts, per round, how often it was
    applied (every rank adds 1 to its own slot of a gradient, avg over the world size)."""

    POLL = 0.2  # poll_every: rank 0 asks the rendezvous at most this often who waits

    def __init__(self, rounds: int, low: int, high: int, timeout: float = 20.0) -> None:
        self.url = f"tcp://127.0.0.1:{free_port()}"
        self.rounds, self.low, self.high, self.timeout = rounds, low, high, timeout
        self.stuck = asyncio.Event()  # the victim is in its step, never to return
        self.smaller: asyncio.Event = asyncio.Event()  # the survivors applied rounds without it
        self.arrived = asyncio.Event()  # the newcomer waits at the rendezvous

    def start(self, die_at: int | None = None, newcomer: bool = False
              ) -> asyncio.Task[training.ElasticResult]:
        return asyncio.create_task(self.peer(die_at, newcomer))

    async def peer(self, die_at: int | None, newcomer: bool) -> training.ElasticResult:
        state = {"times": np.zeros(self.rounds), "w": np.full(3, 7.0 if newcomer else 0.0)}

        async def step(group: p2pcoll.Group, r: int, s: Any) -> dict[str, Any]:
            if r == die_at:
                self.stuck.set()
                await asyncio.sleep(3600)  # until cancelled, while the others wait
            if group.world_size < self.high and r >= (die_at or 0) + 5:
                self.smaller.set()
                # Fast rounds could finish the job before the newcomer reaches the
                # rendezvous (it would then wait there alone): the survivors wait for it,
                # then take a round per poll, so that each round boundary brings rank 0 a
                # census asked after it arrived.
                await self.arrived.wait()
                await asyncio.sleep(self.POLL)
            await asyncio.sleep(0.005)
            one = np.zeros(self.rounds)
            one[r] = 1.0
            return {"times": one, "w": np.full(3, float(r + group.rank))}

        def apply(s: Any, grads: dict[str, Any], r: int) -> None:
            s["times"] += grads["times"]
            s["w"] += grads["w"]

        return await training.train_elastic(
            step, apply, state, rounds=self.rounds, min_world_size=self.low,
            max_world_size=self.high, rendezvous=self.url, timeout=self.timeout,
            poll_every=self.POLL)


async def test_survivors_reform_and_a_newcomer_catches_up() -> None:
    job = Job(rounds=40, low=2, high=3)
    victim = job.start(die_at=8)
    survivors = [job.start(), job.start()]
    await job.stuck.wait()
    victim.cancel()  # it closes its group in the middle of round 8
    with pytest.raises(asyncio.CancelledError):
        await victim
    await job.smaller.wait()
    newcomer = job.start(newcomer=True)
    await newcomer_arrives(job.url, job.arrived)
    results = await asyncio.gather(*survivors, newcomer)

    for result in results:
        check_exactly_once(as_dicts(result), job.rounds)
        assert np.array_equal(result.state["times"], np.ones(job.rounds))  # once per round
    assert all(np.array_equal(r.state["w"], results[0].state["w"]) for r in results)
    for result in results[:2]:
        assert [f.world_size for f in result.formations] == [3, 2, 3]
        assert result.joined_at == 0
        assert result.formations[0].ended.startswith(("PeerLost", "GroupBroken"))
        assert result.formations[1].ended == "admitting"
        assert result.redone == 1  # round 8: computed, lost with the group, run again
    late = results[2]
    assert late.joined_at > 8 and len(late.formations) == 1
    assert late.formations[0].received and late.redone == 0
    assert late.rounds_done == job.rounds - late.joined_at
    assert late.applied == list(range(late.joined_at, job.rounds))


async def test_below_the_minimum_the_job_stops_with_a_clear_error() -> None:
    job = Job(rounds=30, low=3, high=3, timeout=3.0)
    victim = job.start(die_at=4)
    survivors = [job.start(), job.start()]
    await job.stuck.wait()
    victim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim
    errors = await asyncio.gather(*survivors, return_exceptions=True)
    for err in errors:
        assert isinstance(err, training.WorldTooSmall), err
        assert isinstance(err, p2pcoll.RendezvousError)
        assert (err.minimum, err.found, err.round) == (3, 2, 4)
        assert "needs at least 3 peers" in str(err) and "only 2 were" in str(err), err


async def test_a_newcomer_whose_state_does_not_fit_is_told() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"

    async def peer(size: int) -> training.ElasticResult:
        async def step(group: p2pcoll.Group, r: int, s: Any) -> dict[str, Any]:
            return {"w": np.ones(size)}

        return await training.train_elastic(
            step, lambda s, g, r: None, {"w": np.zeros(size)}, rounds=3, min_world_size=2,
            max_world_size=2, rendezvous=url, timeout=10)

    errors = await asyncio.gather(peer(3), peer(4), return_exceptions=True)
    assert all(isinstance(e, p2pcoll.CollectiveMismatch) for e in errors), errors


async def test_arguments_are_checked_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    async def step(group: p2pcoll.Group, r: int, s: Any) -> dict[str, Any]:
        return {}

    def run(**kwargs: Any) -> Any:
        return training.train_elastic(step, lambda s, g, r: None, {"w": np.zeros(2)},
                                      **{"rounds": 1, "rendezvous": "tcp://127.0.0.1:9",
                                         "min_world_size": 1, **kwargs})

    with pytest.raises(TypeError, match="do not pass world_size"):
        await run(world_size=2)
    with pytest.raises(ValueError, match="rounds"):
        await run(rounds=-1)
    with pytest.raises(ValueError, match="op must be"):
        await run(op="max")
    with pytest.raises(ValueError, match="read-only"):
        frozen = np.zeros(2)
        frozen.flags.writeable = False
        await training.train_elastic(step, lambda s, g, r: None, {"w": frozen}, rounds=1,
                                     rendezvous="tcp://127.0.0.1:9", min_world_size=1)
    monkeypatch.delenv("P2PCOLL_MIN_WORLD_SIZE", raising=False)
    with pytest.raises(p2pcoll.SettingsError, match="min_world_size"):
        await run(min_world_size=None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(p2pcoll.SettingsError, match="WORLD_SIZE"):
        await run()


async def test_a_group_of_one_trains_alone() -> None:
    async def step(group: p2pcoll.Group, r: int, s: Any) -> dict[str, Any]:
        return {"w": np.full(2, float(r))}

    def apply(s: Any, grads: dict[str, Any], r: int) -> None:
        s["w"] += grads["w"]

    result = await training.train_elastic(
        step, apply, {"w": np.zeros(2)}, rounds=5, min_world_size=1, max_world_size=1,
        rendezvous=f"tcp://127.0.0.1:{free_port()}", timeout=10)
    assert result.applied == [0, 1, 2, 3, 4] and result.redone == 0
    assert np.array_equal(result.state["w"], np.full(2, 10.0))

