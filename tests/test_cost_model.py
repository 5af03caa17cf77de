"""The cost model of every strategy against what really happens.

Every installed strategy that declares ``traffic()`` is run over in-memory groups of 1..16
ranks, for data sizes that divide by p and that do not, 0 included, with a segment size
small enough that the larger ones are cut into several pipeline segments; each rank's
``messages_sent`` and ``bytes_sent`` (``Group.stats()``) must be the model's exactly. The
critical path (``cost()``) is checked for what is exact about it: positive where a rank
sends anything, its bytes at most the total sent, and nothing at all for p = 1.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import groups_of

import p2pcoll
from p2pcoll.engine.costs import DEFAULT_CONSTANTS, Constants, CostModel, load_constants
from p2pcoll.registry import registry
from p2pcoll.settings import Settings
from p2pcoll.strategy import Cost, Strategy
from p2pcoll.testing import memory_groups

SEGMENT = 1 << 10  # the smallest segment the settings allow: 1000 floats are 4 segments
ELEMENTS = (0, 1, 13, 1000, 3001)  # float32 elements of each rank's data (or part)
ITEM = 4
MODEL = CostModel(segment_bytes=SEGMENT)


def modelled() -> list[Strategy]:
    return [e.strategy for table in registry.entries().values() for e in table.values()
            if e.strategy.traffic(MODEL.workload(e.strategy, 0, 1)) is not None]


def test_every_built_in_has_a_model() -> None:
    missing = [f"{c}.{name}" for c, table in registry.entries().items()
               for name, e in table.items()
               if e.origin.startswith("p2pcoll ") and (
                   e.strategy.cost(MODEL.workload(e.strategy, 8, 4)) is None
                   or e.strategy.traffic(MODEL.workload(e.strategy, 8, 4)) is None)]
    assert missing == []


async def run(g: p2pcoll.Group, strategy: Strategy, m: int) -> None:
    """One collective of ``strategy`` with ``m`` float32 elements per rank (or part)."""
    c, p, r, name = strategy.collective, g.world_size, g.rank, strategy.name
    x = np.full(m, r + 1, np.float32)
    if c == "allreduce":
        await g.allreduce(x, strategy=name)
    elif c == "reduce":
        await g.reduce(x, strategy=name)
    elif c == "reduce_scatter":
        await g.reduce_scatter(x, strategy=name)
    elif c == "broadcast":
        await g.broadcast(x if r == 0 else None, strategy=name)
    elif c == "allgather":
        await g.allgather(x, strategy=name)
    elif c == "gather":
        await g.gather(x, strategy=name)
    elif c == "scatter":
        await g.scatter([x] * p if r == 0 else None, strategy=name)
    elif c == "barrier":
        await g.barrier(strategy=name)
    elif c == "alltoall":
        await g.alltoall([x] * p, strategy=name)
    else:  # pragma: no cover - a new collective needs a line here
        raise AssertionError(c)


def sent(groups: list[p2pcoll.Group]) -> list[tuple[int, int]]:
    return [(s["messages_sent"], s["bytes_sent"]) for s in (g.stats() for g in groups)]


@pytest.mark.parametrize("p", [*range(1, 7), *(pytest.param(p, marks=pytest.mark.slow)
                                                for p in range(7, 17))])
async def test_traffic_is_exact(p: int) -> None:
    wrong: list[str] = []
    async with groups_of(p, segment_bytes=SEGMENT) as groups:
        for strategy in modelled():
            sizes = (0,) if strategy.collective == "barrier" else ELEMENTS
            for m in sizes:
                parts = strategy.collective in ("allgather", "gather", "scatter", "alltoall")
                nbytes = m * ITEM * (p if parts else 1)
                work = MODEL.workload(strategy, nbytes, p, ITEM)
                traffic = strategy.traffic(work)
                assert traffic is not None
                before = sent(groups)
                await asyncio.gather(*(run(g, strategy, m) for g in groups))
                after = sent(groups)
                got = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
                if strategy.collective == "alltoall":  # less its agreement on the lengths:
                    # an allreduce of a p x (2p + 4) table, measured on its own
                    table = np.zeros((p, 2 * p + 4), np.int64)
                    before = sent(groups)
                    await asyncio.gather(*(g.allreduce(table) for g in groups))
                    after = sent(groups)
                    got = [(m0 - (a[0] - b[0]), b0 - (a[1] - b[1])) for (m0, b0), a, b
                           in zip(got, after, before, strict=True)]
                want = list(zip(traffic.messages, traffic.bytes_sent, strict=True))
                if got != want:
                    wrong.append(f"{strategy.collective}.{strategy.name} p={p} m={m} "
                                 f"S={work.segments}: measured {got}, model {want}")
                check_cost(strategy, work, want, wrong)
    assert wrong == [], "\n".join(wrong)


def check_cost(strategy: Strategy, work: Any, per_rank: list[tuple[int, int]],
               wrong: list[str]) -> None:
    cost = strategy.cost(work)
    assert cost is not None
    where = f"{strategy.collective}.{strategy.name} p={work.size} n={work.nbytes}"
    if work.size == 1 and (cost.rounds, cost.sent, cost.reduced) != (0, 0, 0):
        wrong.append(f"{where}: a group of one costs {cost}")
    if any(m for m, _ in per_rank) and cost.rounds <= 0:
        wrong.append(f"{where}: messages are sent but the cost has no rounds: {cost}")
    if cost.sent > sum(b for _, b in per_rank) + 1e-6:
        wrong.append(f"{where}: more bytes on the critical path than sent in all: {cost}")


def test_workload_segments_like_the_executor() -> None:
    ring = registry.get("allreduce", "ring")
    rd = registry.get("allreduce", "recursive_doubling")
    model = CostModel(segment_bytes=1 << 20)
    assert model.workload(ring, 16 << 20, 4).segments == 4  # chunks of 4 MiB
    assert model.workload(rd, 16 << 20, 4).segments == 16  # the whole 16 MiB
    assert model.workload(rd, 0, 4).segments == 1
    capped = CostModel(segment_bytes=1 << 30, max_message_bytes=1 << 20)
    assert capped.workload(rd, 8 << 20, 2).segments > 8  # the cap wins (header room)


def test_textbook_costs_at_a_power_of_two() -> None:
    """The formulas of Thakur, Rabenseifner & Gropp at p = 8, n = 8 KiB (one segment)."""
    p, n = 8, 8 << 10
    got = {}
    for c, name in [("allreduce", "ring"), ("allreduce", "recursive_doubling"),
                    ("allreduce", "rabenseifner"), ("broadcast", "binomial"),
                    ("allgather", "recursive_doubling"), ("reduce_scatter", "ring")]:
        s = registry.get(c, name)
        cost = s.cost(CostModel().workload(s, n, p))
        assert cost is not None
        got[c, name] = (cost.rounds, cost.sent, cost.reduced)
    assert got["allreduce", "ring"] == (14, 2 * 7 / 8 * n, 7 / 8 * n)
    assert got["allreduce", "recursive_doubling"] == (3, 3 * n, 3 * n)
    assert got["allreduce", "rabenseifner"] == (6, 2 * 7 / 8 * n, 7 / 8 * n)
    assert got["broadcast", "binomial"] == (3, 3 * n, 0)
    assert got["allgather", "recursive_doubling"] == (3, 7 / 8 * n, 0)
    assert got["reduce_scatter", "ring"] == (7, 7 / 8 * n, 7 / 8 * n)


def test_fold_corrections_at_other_p() -> None:
    """p = 6: p' = 4, two ranks folded: the MPICH fold adds a hand-in and a hand-back."""
    p, n = 6, 4 << 10
    rd = registry.get("allreduce", "recursive_doubling")
    rab = registry.get("allreduce", "rabenseifner")
    model = CostModel()
    assert rd.cost(model.workload(rd, n, p)) == Cost(4, 4 * n, 3 * n)
    cost = rab.cost(model.workload(rab, n, p))
    assert cost is not None
    assert (cost.rounds, cost.sent, cost.reduced) == (6, 2 * 3 / 4 * n + 2 * n, 3 / 4 * n + n)


def test_more_ranks_than_cores_count_every_message() -> None:
    """The host term: zero while a host has a core per rank, else the CPU time of all the
    host's messages over its cores (what makes the star win on 4 peers of 2 cores)."""
    rb = registry.get("allreduce", "reduce_broadcast")
    rd = registry.get("allreduce", "recursive_doubling")
    constants = Constants(alpha=1e-4, beta=0, gamma=0, overhead=1e-3)
    roomy, crowded = CostModel(constants, local=4, cores=4), CostModel(constants, local=4, cores=2)
    for s in (rb, rd):
        assert roomy.contention(s, roomy.workload(s, 4096, 4)) == 0
    # 4 ranks on 2 cores: rb sends 2(p-1) = 6 messages in all, rd p lg p = 8.
    assert crowded.contention(rb, crowded.workload(rb, 4096, 4)) == pytest.approx(6e-3 / 2)
    assert crowded.contention(rd, crowded.workload(rd, 4096, 4)) == pytest.approx(8e-3 / 2)
    # Half of the group on this host: half of the messages.
    half = CostModel(constants, local=4, cores=2)
    assert half.contention(rd, half.workload(rd, 4096, 8)) == pytest.approx(
        1e-3 * 8 * 3 * (4 / 8) / 2)


def test_constants_file(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"tcp": {"alpha": 1e-5, "beta": 1e-10}, "ipc": {}}))
    table = load_constants(path)
    assert table["tcp"] == Constants(1e-5, 1e-10, DEFAULT_CONSTANTS["tcp"].gamma,
                                     DEFAULT_CONSTANTS["tcp"].overhead)
    assert table["ipc"] == DEFAULT_CONSTANTS["ipc"]
    for text, message in [("[1]", "not an object"), ('{"rdma": {}}', "unknown transport"),
                          ('{"ipc": {"delta": 1}}', "unknown field ipc.delta"),
                          ('{"ipc": {"alpha": -1}}', "is not a number of seconds"),
                          ('{"ipc": {"alpha": true}}', "is not a number of seconds"),
                          ("{", "cannot read the cost model")]:
        path.write_text(text)
        with pytest.raises(p2pcoll.SettingsError, match=message) as info:
            load_constants(path)
        assert "$P2PCOLL_COST_MODEL=" in str(info.value)
    with pytest.raises(p2pcoll.SettingsError, match="cannot read"):
        load_constants(tmp_path / "missing.json")


async def test_a_group_uses_its_constants_file(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    # Messages nearly free, bandwidth dear: the ring beats recursive doubling at 4K already.
    path.write_text(json.dumps({"ipc": {"alpha": 1e-9, "beta": 1e-6, "overhead": 0}}))
    async with groups_of(4, cost_model=str(path)) as groups:
        assert groups[0]._costs().constants.alpha == 1e-9
        x = np.ones(1024, np.float32)
        await asyncio.gather(*(g.allreduce(x) for g in groups))
        assert registry.auto_name("allreduce", x.nbytes, 4, groups[0]._costs()) in (
            "rabenseifner", "ring", "direct")
    path.write_text("{")
    with pytest.raises(p2pcoll.SettingsError, match="cannot read the cost model"):
        await memory_groups(2, cost_model=str(path))
    assert Settings.resolve({"P2PCOLL_COST_MODEL": str(path)}).cost_model == str(path)


def test_repeated_sends_are_cheap_only_where_peers_read_one_copy() -> None:
    """A root's sends of one piece: over sockets p-1 messages and (p-1)n bytes one after
    the other (the textbook's single port); over the shared-memory rings one copy that
    every peer reads, so one alpha and n beta (the rest is the host term's CPU)."""
    root = registry.get("broadcast", "root")
    p, n = 4, 1 << 16
    cost = root.cost(CostModel().workload(root, n, p))
    assert cost == Cost(3, 3 * n, 0, repeats=2, repeated=2 * n)
    assert cost.time(1.0, 1e-6, 0, repeat=1.0) == pytest.approx(3 + 3 * n * 1e-6)
    assert cost.time(1.0, 1e-6, 0, repeat=0.0) == pytest.approx(1 + n * 1e-6)
    ipc, tcp = DEFAULT_CONSTANTS["ipc"], DEFAULT_CONSTANTS["tcp"]
    assert (ipc.repeat, tcp.repeat) == (0.0, 1.0)
    # Without the rings (P2PCOLL_SHM=0) ipc links copy every send: repeat is 1.
    assert CostModel.for_settings(Settings(shm=False), "ipc").constants.repeat == 1.0
    assert CostModel.for_settings(Settings(), "ipc").constants.repeat == 0.0
    # Two ranks: nothing to repeat.
    two = root.cost(CostModel().workload(root, n, 2))
    assert two is not None and (two.repeats, two.repeated) == (0, 0)


def test_repeat_in_a_cost_model_file_is_a_fraction(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"tcp": {"repeat": 0.5}}))
    assert load_constants(path)["tcp"].repeat == 0.5
    path.write_text(json.dumps({"tcp": {"repeat": 2}}))
    with pytest.raises(p2pcoll.SettingsError, match=r"tcp\.repeat = 2 is not a fraction"):
        load_constants(path)
