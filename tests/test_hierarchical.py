"""The host-aware (hierarchical) allreduce, broadcast and allgather.

The same correctness matrix as every strategy (tests/test_strategy_schedules.py, whose
lockstep simulator runs here with the hosts in the context), over host layouts: one host,
one rank per host, hosts of equal size in blocks, hosts interleaved, uneven hosts; every
root. Then bit-identical results on every rank, the traffic per level against the cost
model (messages and bytes that cross hosts, counted by the transport's ``sent`` hook), and
live groups in memory and over real sockets with a distinct ``P2PCOLL_HOST_ID`` per host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import test_strategy_schedules as lockstep

import p2pcoll
from p2pcoll.engine.costs import DEFAULT_CONSTANTS, Constants, CostModel, crossing
from p2pcoll.registry import registry
from p2pcoll.strategy import Context, Send, Strategy, Workload, host_numbers
from p2pcoll.testing import memory_groups, run_ranks

COLLECTIVES = ("allreduce", "broadcast", "allgather")


def layouts(p: int) -> Iterator[tuple[int, ...]]:
    """Host layouts of p ranks: one host, one rank per host, blocks of every size that
    divides p, interleaved hosts, and two uneven ones."""
    seen = set()
    candidates = [tuple([0] * p), tuple(range(p))]
    for k in range(2, p):
        if p % k == 0:
            candidates.append(tuple(r // k for r in range(p)))  # blocks of k
            candidates.append(tuple(r % (p // k) for r in range(p)))  # interleaved
    if p >= 3:
        candidates.append(tuple([0] * (p - 1) + [1]))  # p-1 and 1
        rng = np.random.default_rng(p)
        candidates.append(host_numbers(rng.integers(0, max(2, p // 3), p).tolist()))
    for hosts in candidates:
        hosts = host_numbers(hosts)
        if hosts not in seen:
            seen.add(hosts)
            yield hosts


def hierarchical(collective: str) -> Strategy:
    return registry.get(collective, "hierarchical")



def simulate(strategy: Strategy, hosts: tuple[int, ...], root: int, nelem: int,
             monkeypatch: pytest.MonkeyPatch, dtype: type = np.int64) -> Any:
    """The lockstep simulator of test_strategy_schedules, its contexts given ``hosts``."""
    def context(rank: int, size: int, root: int = 0) -> Context:
        return Context(rank, size, root, hosts)

    monkeypatch.setattr(lockstep, "Context", context)
    return lockstep.run_collective(strategy, len(hosts), root, nelem,
                                   np.random.default_rng(7), dtype)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_layout_every_root_meets_the_contract(
        collective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = hierarchical(collective)
    for p in range(1, 13):
        for hosts in layouts(p):
            for root in range(p) if collective == "broadcast" else (0,):
                for nelem in (0, 1, 7, 100):
                    simulate(strategy, hosts, root, nelem, monkeypatch)


@pytest.mark.parametrize("hosts", [(0, 0, 0, 1, 1, 1, 2, 2, 2), (0, 1, 0, 1, 0, 1, 2),
                                   (0, 0, 0, 0, 0, 1), (0, 0, 1, 1, 1, 1, 1, 2, 2, 2),
                                   (0, 1, 2, 3, 4)])
def test_allreduce_is_bitwise_identical_on_every_rank(
        hosts: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    _, data = simulate(hierarchical("allreduce"), hosts, 0, 1001, monkeypatch, np.float32)
    # float32 sums in different orders differ in their last bits; these must not
    first = np.concatenate(data[0])
    for chunks in data[1:]:
        assert np.concatenate(chunks).tobytes() == first.tobytes()


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_traffic_is_what_the_schedules_send(
        collective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = hierarchical(collective)
    for hosts in [(0, 0, 1, 1), (0, 0, 0, 1, 1, 2, 2, 2), (0, 1, 0, 1, 2, 2, 0)]:
        p, nelem = len(hosts), 24
        moved, _ = simulate(strategy, hosts, 0, nelem, monkeypatch)
        nbytes = nelem * 8 * (p if collective == "allgather" else 1)
        declared = strategy.traffic(Workload(p, nbytes, 8, hosts=hosts))
        assert declared is not None
        assert list(declared.bytes_sent) == moved.bytes_sent, hosts
        assert list(declared.messages) == moved.messages_sent, hosts


def test_uneven_hosts_take_their_lanes_from_the_smallest_host() -> None:
    """Hosts of 5, 2 and 3 ranks: 2 lanes. A host's ranks are dealt into the lanes by local
    index mod 2; only the first 2 of each host talk across hosts, each with its peers of
    the same local index (its lane on every host), and the rest only with their lane."""
    from p2pcoll.engine.plan import plan

    hosts = (0, 0, 0, 0, 0, 1, 1, 2, 2, 2)
    h, p = hierarchical("allreduce"), len(hosts)
    peers = {}
    for rank in range(p):
        steps = plan(h, Context(rank, p, 0, hosts), p)
        peers[rank] = {op.to if isinstance(op, Send) else op.frm for ops in steps for op in ops}
    across = {r: {q for q in peers[r] if hosts[q] != hosts[r]} for r in range(p)}
    assert across == {0: {5, 7}, 1: {6, 8}, 5: {0, 7}, 6: {1, 8}, 7: {0, 5}, 8: {1, 6},
                      2: set(), 3: set(), 4: set(), 9: set()}
    # lane 0 of host 0 is ranks 0, 2, 4 (a tree onto 0), lane 1 ranks 1, 3
    assert peers[2] == {0} and peers[4] == {0} and peers[3] == {1} and peers[9] == {7}


def test_leaders_and_local_ranks_of_a_layout() -> None:
    ctx = Context(4, 7, root=5, hosts=(0, 1, 0, 1, 2, 2, 0))
    assert (ctx.host, ctx.nhosts, ctx.local_ranks, ctx.local_rank) == (2, 3, (4, 5), 0)
    assert ctx.leaders == (0, 1, 5)  # the root leads its host
    assert ctx.leader == 5


def test_host_numbers_and_bad_contexts() -> None:
    assert host_numbers(["b", "a", "b", "c"]) == (0, 1, 0, 2)
    assert Context(0, 3).nhosts == 1 and Context(2, 3).local_ranks == (0, 1, 2)
    with pytest.raises(ValueError, match="order of first appearance"):
        Context(0, 3, 0, (1, 0, 1))
    with pytest.raises(ValueError, match="must be empty or 3"):
        Context(0, 3, 0, (0, 1))
    ctx = Context(3, 4, 0, (0, 0, 1, 1))
    with pytest.raises(ValueError, match="rank 3 is not in the sub-group"):
        ctx.within((0, 1))
    with pytest.raises(ValueError, match="the root 0 is not in"):
        ctx.within((2, 3), root=0)


def test_a_subgroup_runs_a_textbook_schedule_in_real_ranks() -> None:
    from p2pcoll.strategy import Recv, Reduce

    ctx = Context(5, 6, 0, (0, 1, 0, 1, 0, 1))
    host = ctx.within(ctx.local_ranks, root=ctx.leader)  # ranks 1, 3, 5; leader 1
    assert (host.ctx.rank, host.ctx.size, host.ctx.root) == (2, 3, 0)
    steps = list(host.steps([Send(0), [Recv(1, 2), Reduce(0, range(1, 2))]]))
    assert steps == [Send(1), [Recv(3, 2), Reduce(1, range(1, 2))]]


def test_old_cost_model_files_still_load_and_are_the_two_levels(tmp_path: Any) -> None:
    from p2pcoll.engine.costs import load_constants

    path = tmp_path / "model.json"
    path.write_text('{"ipc": {"alpha": 3e-4}, "tcp": {"alpha": 2e-3, "beta": 8e-9}}')
    table = load_constants(path)
    model = CostModel.for_group(p2pcoll.Settings(), ["ipc://x"] * 4, 0, table, cores=2,
                                hosts=["a", "a", "b", "b"])
    assert model.constants.alpha == 3e-4 and model.between == table["tcp"]
    one = CostModel.for_group(p2pcoll.Settings(), ["tcp://x"] * 4, 0, table, cores=2)
    assert one.levels == 1 and one.constants == table["tcp"]  # as before: no hosts given


# --- live groups: traffic per level against the cost model --------------------------------


async def _counted(hosts: tuple[int, ...], fn: Any) -> tuple[list[Any], dict[int, list[int]]]:
    """Run ``fn(group, rank)`` on memory groups with ``hosts``; per host, [messages, bytes]
    that left it (to another host) and stayed in it."""
    groups = await memory_groups(len(hosts), hosts=[f"node{h}" for h in hosts])
    crossed: dict[int, list[int]] = {h: [0, 0, 0, 0] for h in set(hosts)}
    try:
        for rank, g in enumerate(groups):
            def hook(dst: int, header: Any, nbytes: int, src: int = rank) -> None:
                where = crossed[hosts[src]]
                off = 0 if hosts[dst] != hosts[src] else 2
                where[off] += 1
                where[off + 1] += nbytes
            g.session.transport.sent = hook
        results = await asyncio.gather(*(fn(g, r) for r, g in enumerate(groups)))
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    return list(results), crossed


@pytest.mark.parametrize("hosts", [(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                   (0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                   (0, 1, 2, 0, 1, 2, 0, 1, 2)])
async def test_allreduce_traffic_per_level_is_the_cost_models(hosts: tuple[int, ...]) -> None:
    p, nhosts = len(hosts), max(hosts) + 1
    strategy = hierarchical("allreduce")
    count = 64 * p  # elements: the ring's blocks are exact
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32)
              for r in range(p)]

    async def fn(g: p2pcoll.Group, rank: int) -> np.ndarray:
        return await g.allreduce(inputs[rank], strategy="hierarchical")

    results, crossed = await _counted(hosts, fn)
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes()
    np.testing.assert_allclose(results[0], np.sum(inputs, axis=0), rtol=1e-4, atol=1e-4)
    model = CostModel.for_group(p2pcoll.Settings(), ["inproc://x"] * p, 0, cores=2,
                                hosts=[str(h) for h in hosts])
    work = model.workload(strategy, count * 4, p, 4)
    cost = strategy.cost(work)
    assert work.segments == 1
    k = p // nhosts  # the lanes
    for h in range(nhosts):
        messages, nbytes, _, _ = crossed[h]
        # every lane runs a ring across hosts on its 1/k of the data: 2(H-1) rounds of
        # n/(kH), k at once, so 2(H-1)/H·n leaves the host: the least any allreduce can
        assert cost.remote_rounds == 2 * (nhosts - 1)
        assert messages == k * cost.remote_rounds
        assert nbytes == cost.remote_sent == 2 * (nhosts - 1) * count * 4 // nhosts
    inside, between = model.split(strategy, cost, p)
    assert between.sent == cost.remote_sent and inside.rounds == cost.rounds - cost.remote_rounds
    # everything else stays in the hosts: what traffic() says all ranks send, less the above
    traffic = strategy.traffic(work)
    assert sum(c[1] + c[3] for c in crossed.values()) == sum(traffic.bytes_sent)
    assert sum(c[0] + c[2] for c in crossed.values()) == sum(traffic.messages)


async def test_a_flat_ring_crosses_hosts_in_every_round() -> None:
    hosts = (0, 0, 0, 0, 1, 1, 1, 1)
    p, count = len(hosts), 80

    async def fn(g: p2pcoll.Group, rank: int) -> np.ndarray:
        return await g.allreduce(np.ones(count, np.float32), strategy="ring")

    results, crossed = await _counted(hosts, fn)
    assert all((r == p).all() for r in results)
    model = CostModel.for_group(p2pcoll.Settings(), ["inproc://x"] * p, 0, cores=2,
                                hosts=[str(h) for h in hosts])
    ring = registry.get("allreduce", "ring")
    rounds, share, sharing = crossing(ring, p, hosts)
    assert (rounds, share, sharing) == (1.0, 1.0, 1.0)  # one rank per host talks across
    # the one rank of each host at the boundary sends 2(p-1) messages of n/p across
    assert crossed[0][0] == crossed[1][0] == 2 * (p - 1)
    assert crossed[0][1] == 2 * (p - 1) * count * 4 // p
    cost = ring.cost(model.workload(ring, count * 4, p, 4))
    _, between = model.split(ring, cost, p)
    assert between.rounds == cost.rounds and between.sent == crossed[0][1]


async def test_hierarchical_broadcast_and_allgather_live_every_root() -> None:
    hosts = (0, 1, 1, 0, 2, 2, 2)
    p = len(hosts)
    for root in range(p):
        data = [np.arange(5, dtype=np.int32) + 100 * r for r in range(p)]

        async def bcast(g: p2pcoll.Group, rank: int, root: int = root,
                        data: list[np.ndarray] = data) -> np.ndarray:
            return await g.broadcast(data[rank], root=root, strategy="hierarchical")

        results, crossed = await _counted(hosts, bcast)
        for r in results:
            np.testing.assert_array_equal(r, data[root])
        # a binomial tree among 3 leaders: 2 messages cross hosts in all
        assert sum(c[0] for c in crossed.values()) == 2

    async def gather(g: p2pcoll.Group, rank: int) -> list[np.ndarray]:
        return await g.allgather(np.full(3, rank, np.int16), strategy="hierarchical")

    results, _ = await _counted(hosts, gather)
    for parts in results:
        assert [int(x[0]) for x in parts] == list(range(p))


# --- auto under a two-level model ---------------------------------------------------------


def _model(per_host: list[int], tcp_beta: float = 8e-9) -> CostModel:
    hosts = [str(h) for h, k in enumerate(per_host) for _ in range(k)]
    constants = dict(DEFAULT_CONSTANTS)
    constants["tcp"] = Constants(alpha=1e-3, beta=tcp_beta, gamma=0.2e-9)
    return CostModel.for_group(p2pcoll.Settings(), ["ipc://x"] * len(hosts), 0, constants,
                               cores=2, hosts=hosts)


def test_auto_picks_hierarchical_only_on_shared_hosts() -> None:
    two_by_eight = _model([8, 8])
    assert two_by_eight.levels == 2 and two_by_eight.shared_hosts
    assert registry.auto_name("allgather", 16 << 20, 16, two_by_eight) == "hierarchical"
    assert registry.auto_name("broadcast", 4096, 16, two_by_eight) == "hierarchical"
    # one rank per host, or one host: a hierarchical schedule is a flat one; auto leaves it
    for model, p in ((_model([1] * 8), 8), (_model([8]), 8), (CostModel(), 16)):
        for collective in COLLECTIVES:
            for n in (4096, 1 << 20, 64 << 20):
                assert registry.auto_name(collective, n, p, model) != "hierarchical"


def test_auto_picks_hierarchical_allreduce_where_flat_ones_cross_every_round() -> None:
    # hosts interleaved (0, 1, 0, 1, ...): every exchange of a flat schedule crosses
    hosts = [str(r % 2) for r in range(16)]
    constants = dict(DEFAULT_CONSTANTS)
    constants["tcp"] = Constants(alpha=1e-3, beta=8e-9, gamma=0.2e-9)
    model = CostModel.for_group(p2pcoll.Settings(), ["ipc://x"] * 16, 0, constants, cores=2,
                                hosts=hosts)
    for n in (1 << 20, 16 << 20, 64 << 20):
        assert registry.auto_name("allreduce", n, 16, model) == "hierarchical"


@pytest.mark.parametrize("per_host", [[4, 4, 4, 4], [8, 8], [2] * 8])
def test_what_leaves_a_host_against_the_lower_bound(per_host: list[int]) -> None:
    """Any allreduce must move 2(H-1)/H·n bytes through each host's link (each host's data
    must leave it, in part, and the result come back). The hierarchical allreduce and
    Rabenseifner on host-contiguous ranks (which cross hosts only in their last rounds of
    halving and first of doubling) push exactly that; the flat ring 2(p-1)/p·n."""
    model, p, n = _model(per_host), sum(per_host), 64 << 20
    hosts = len(per_host)
    bound = 2 * (hosts - 1) / hosts * n
    pushed = {}
    for name in ("hierarchical", "rabenseifner", "ring"):
        strategy = registry.get("allreduce", name)
        _, between = model.split(strategy, strategy.cost(model.workload(strategy, n, p)), p)
        pushed[name] = between.sent
    assert pushed["hierarchical"] == pytest.approx(bound)
    assert pushed["rabenseifner"] == pytest.approx(bound)
    assert pushed["ring"] == pytest.approx(2 * (p - 1) / p * n)


def test_two_levels_charge_flat_strategies_for_crossing() -> None:
    ring = registry.get("allreduce", "ring")
    one_level = CostModel()
    two = _model([4, 4, 4, 4])
    # a ring over 4 hosts waits on the network in every round
    t_one, t_two = one_level.predict(ring, 16 << 20, 16), two.predict(ring, 16 << 20, 16)
    assert t_one is not None and t_two is not None and t_two > 5 * t_one
    # hierarchical: only the 2(H-1) rounds of its rings across hosts pay the network
    h = hierarchical("allreduce")
    work = two.workload(h, 16 << 20, 16)
    cost = h.cost(work)
    inside, between = two.split(h, cost, 16)
    # (per wave of segments in flight: its messages carry whole segments, see whole_messages)
    assert between.rounds == 6 * work.waves and between.sent == 2 * 3 / 4 * (16 << 20)


def test_plans_depend_on_the_hosts() -> None:
    from p2pcoll.engine.plan import plan

    h = hierarchical("allreduce")
    a = plan(h, Context(1, 4, 0, (0, 0, 1, 1)), 4)
    b = plan(h, Context(1, 4, 0, (0, 1, 0, 1)), 4)
    assert a != b
    # the first step is the reduce-scatter inside my host: with rank 0, or with rank 3
    assert {op.to if isinstance(op, Send) else op.frm for op in a[0]} == {0}
    assert {op.to if isinstance(op, Send) else op.frm for op in b[0]} == {3}


async def test_a_group_sees_its_hosts_and_auto_runs_hierarchical() -> None:
    groups = await memory_groups(8, hosts=["a", "a", "a", "a", "b", "b", "b", "b"])
    try:
        runner = groups[5].session.runner
        assert runner.hosts == (0, 0, 0, 0, 1, 1, 1, 1)
        assert runner.costs().levels == 2
        x = np.ones(1000, np.float32)
        await asyncio.gather(*(g.allreduce(x) for g in groups))
        # auto: whatever the model picks, it is the same on every rank and recorded
        picks = {repr(g.stats()["collectives_by_strategy"]) for g in groups}
        assert len(picks) == 1
        prepared = next(iter(runner.programs.values()))
        assert prepared.ctx.hosts == runner.hosts
    finally:
        await asyncio.gather(*(g.close() for g in groups))


def test_memory_groups_and_run_ranks_reject_bad_hosts() -> None:
    with pytest.raises(ValueError, match="one host per rank"):
        asyncio.run(memory_groups(3, hosts=["a", "b"]))
    with pytest.raises(ValueError, match="host_ids must be 2"):
        asyncio.run(run_ranks(2, lambda g: g.barrier(), host_ids=["a"]))


# --- real sockets: a distinct P2PCOLL_HOST_ID per host ------------------------------------


async def test_over_sockets_with_distinct_host_ids() -> None:
    hosts = ["left", "left", "right", "right", "right"]
    p = len(hosts)
    inputs = [np.random.default_rng(r).standard_normal(300_000).astype(np.float32)
              for r in range(p)]
    expected = np.sum(inputs, axis=0)

    async def fn(g: p2pcoll.Group) -> tuple[Any, ...]:
        runner = g.session.runner
        total = await g.allreduce(inputs[g.rank], strategy="hierarchical")
        again = await g.allreduce(inputs[g.rank], strategy="hierarchical")
        sent = await g.broadcast(inputs[g.rank].copy(), root=3, strategy="hierarchical")
        parts = await g.allgather(np.full(2, g.rank, np.int64), strategy="hierarchical")
        links = [e.partition("://")[0] for e in g.membership.endpoints]
        return runner.hosts, runner.costs().levels, total, again, sent, parts, links

    results = await run_ranks(p, fn, host_ids=hosts, transport="auto")
    for rank, (hosts_seen, levels, total, again, sent, parts, links) in enumerate(results):
        assert hosts_seen == (0, 0, 1, 1, 1) and levels == 2
        # tcp to the other host, never ipc (nor the shared memory that goes with it)
        for r in range(p):
            if r != rank:
                assert links[r] == ("ipc" if hosts[r] == hosts[rank] else "tcp"), (rank, r)
        assert total.tobytes() == results[0][2].tobytes() == again.tobytes()
        np.testing.assert_allclose(total, expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(sent, inputs[3])
        assert [int(x[0]) for x in parts] == list(range(p))


# --- p2pcoll simulate --hosts H --per-host K ----------------------------------------------


def _simulate(*argv: str) -> tuple[int, str, str]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "p2pcoll", "simulate", *argv],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_simulate_prices_two_levels() -> None:
    code, out, err = _simulate("--hosts", "2", "--per-host", "8", "--size", "4K",
                               "--collective", "broadcast")
    assert code == 0, err
    assert "broadcast, 2 hosts x 8 ranks, 4K" in out
    assert "# between hosts (tcp)" in out and "# inside a host (ipc)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line and not line.startswith(("#", "strategy", "best", "crossovers"))}
    # the hierarchical broadcast crosses hosts once, with the data once
    assert rows["hierarchical"][-2:] == ["1", "4096"]
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    model = CostModel.for_group(p2pcoll.Settings(), ["ipc://x"] * 16, 0,
                                hosts=[str(r // 8) for r in range(16)])
    assert best.split()[1] == registry.auto_name("broadcast", 4096, 16, model)


def test_simulate_takes_the_link_between_hosts_and_checks_the_layout() -> None:
    code, out, _ = _simulate("--hosts", "4", "-n", "16", "--size", "16M",
                             "--bandwidth", "1Gbit", "--latency", "0.5ms")
    assert code == 0
    assert "4 hosts x 4 ranks" in out
    assert "beta 8 ns/B (0.125 GB/s) (the link given)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line and not line.startswith(("#", "strategy", "best", "crossovers"))}
    assert float(rows["ring"][-2]) == 30  # a ring over 4 hosts: every round crosses
    code, _, err = _simulate("--hosts", "3", "-n", "8")
    assert code != 0 and "cannot be cut into --hosts 3 evenly" in err


@pytest.mark.parametrize(("argv", "problem"), [
    (["--hosts", "2", "--per-host", "2", "-n", "5"], "-n 5 disagrees with --hosts 2"),
    (["--per-host", "0"], "--per-host must be at least 1"),
    (["--hosts", "2"], "--hosts needs --per-host or -n"),
])
def test_simulate_names_a_bad_layout(argv: list[str], problem: str) -> None:
    import argparse

    from p2pcoll.bench import simulate

    parser = argparse.ArgumentParser()
    simulate.configure_parser(parser)
    with pytest.raises(ValueError, match=problem):
        simulate.report(parser.parse_args(argv))


# --- many ranks ---------------------------------------------------------------------------


@pytest.mark.parametrize("collective", [
    pytest.param(c, marks=pytest.mark.slow) if c == "allgather" else c for c in COLLECTIVES])
def test_large_layouts_in_lockstep(collective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = hierarchical(collective)
    rng = np.random.default_rng(3)
    uneven = host_numbers(rng.integers(0, 20, 200).tolist())
    for hosts in [tuple(r // 8 for r in range(128)), uneven]:
        simulate(strategy, hosts, len(hosts) - 1 if collective == "broadcast" else 0, 300,
                 monkeypatch)


@pytest.mark.scale
async def test_256_ranks_on_32_hosts_in_memory() -> None:
    hosts = [f"node{r // 8}" for r in range(256)]
    groups = await memory_groups(256, hosts=hosts, collective_timeout=120)
    try:
        x = [np.full(4096, r, np.int64) for r in range(256)]
        out = await asyncio.gather(*(g.allreduce(x[r], strategy="hierarchical")
                                     for r, g in enumerate(groups)))
        assert all((o == sum(range(256))).all() for o in out)
        got = await asyncio.gather(*(g.broadcast(x[r], root=100, strategy="hierarchical")
                                     for r, g in enumerate(groups)))
        assert all((b == 100).all() for b in got)
    finally:
        await asyncio.gather(*(g.close() for g in groups))
