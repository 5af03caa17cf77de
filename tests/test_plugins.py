"""Strategy plugins: the example third-party package, the registry's checks, and the rules.

The example plugin (examples/custom_strategy, distribution ``p2pcoll-example-direct``) must be
installed; CI installs it before running the tests. When it is missing these tests fail and
say how to install it: a skipped plugin test would hide a broken entry-point mechanism.
"""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.registry import Entry, registry
from p2pcoll.strategy import Context, Recv, Reduce, Schedule, Send, Strategy
from p2pcoll.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
DIST = "p2pcoll-example-direct"
INSTALL = "pip install -e examples/custom_strategy"


def direct() -> Entry:
    entry = registry.entries()["allreduce"].get("direct")
    if entry is None:
        pytest.fail(f"the example plugin {DIST} is not installed; run `{INSTALL}`")
    return entry


def inputs(p: int, nelem: int) -> list[np.ndarray]:
    """Integer-valued float32 data, so every order of summation gives the exact sum."""
    rng = np.random.default_rng(nelem * 31 + p)
    return [rng.integers(-100, 100, nelem).astype(np.float32) for _ in range(p)]


# --- the example third-party plugin ------------------------------------------------------


def test_example_plugin_is_listed_with_its_distribution() -> None:
    entry = direct()
    assert "direct" in p2pcoll.available_strategies()["allreduce"]
    normalized = re.sub(r"[-_.]+", "-", entry.origin.lower())
    assert DIST in normalized, f"origin {entry.origin!r} does not name {DIST}"
    assert "p2pcoll_direct:DirectAllreduce" in entry.origin
    assert type(entry.strategy).__module__ == "p2pcoll_direct"


@pytest.mark.parametrize("p", range(1, 7))
async def test_example_plugin_selected_per_call(p: int) -> None:
    """strategy="direct" on every call; the traffic identifies the strategy.

    Rank r sends every chunk but its own, then its own chunk to the p-1 others: n + (p-2)·c_r
    bytes, 2(p-1)/p·n when p divides the count. For p >= 4 and uneven chunks no other
    allreduce strategy sends exactly that.
    """
    direct()
    even, uneven = 60 * 7, 60 * 7 + 5  # 420 is divisible by 1..6; 425 is not for p = 2..6

    async def fn(g: p2pcoll.Group) -> tuple[list[np.ndarray], list[dict[str, int]], int]:
        results, sent = [], []
        for nelem in (even, uneven):
            before = g.stats()
            results.append(await g.allreduce(inputs(p, nelem)[g.rank], strategy="direct"))
            after = g.stats()
            # Only what this rank sent is attributable to one call: a message of a call may
            # arrive before the receiving rank has even started it.
            sent.append({k: after[k] - before[k] for k in ("bytes_sent", "messages_sent")})
        return results, sent, g.stats()["bytes_received"]  # counted since join

    out = await run_ranks(p, fn)
    received = [0] * p
    for i, nelem in enumerate((even, uneven)):
        expected = np.sum(inputs(p, nelem), axis=0)
        chunk = [4 * len(c) for c in np.array_split(np.empty(nelem), p)]
        for rank, (results, sent, _) in enumerate(out):
            np.testing.assert_array_equal(results[i], expected, err_msg=f"rank {rank} of {p}")
            assert results[i].tobytes() == out[0][0][i].tobytes()
            assert sent[i]["bytes_sent"] == 4 * nelem + (p - 2) * chunk[rank]
            assert sent[i]["messages_sent"] == 2 * (p - 1)
            if nelem == even:
                assert sent[i]["bytes_sent"] == 2 * (p - 1) * 4 * nelem // p
            received[rank] += 4 * nelem + (p - 2) * chunk[rank]
    assert [bytes_received for _, _, bytes_received in out] == received


async def _one_names_it_the_others_rely_on(p: int, **join_kwargs: Any) -> None:
    """Rank 0 asks for "direct" by name; the others rely on the selection being tested.

    The strategy's name is part of the signature every message carries, so if the others
    picked any other strategy every rank would raise CollectiveMismatch instead.
    """
    nelem = 1001

    async def fn(g: p2pcoll.Group) -> np.ndarray:
        mine = inputs(p, nelem)[g.rank]
        if g.rank == 0:
            return await g.allreduce(mine, strategy="direct", timeout=10)
        return await g.allreduce(mine, timeout=10)

    results = await run_ranks(p, fn, **join_kwargs)
    expected = np.sum(inputs(p, nelem), axis=0)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result, expected, err_msg=f"rank {rank} of {p}")


@pytest.mark.parametrize("p", range(1, 7))
async def test_example_plugin_selected_per_group(p: int) -> None:
    direct()
    await _one_names_it_the_others_rely_on(p, strategies={"allreduce": "direct"})


@pytest.mark.parametrize("p", range(1, 7))
async def test_example_plugin_selected_from_the_environment(
    p: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct()
    monkeypatch.setenv("P2PCOLL_ALLREDUCE", "direct")
    await _one_names_it_the_others_rely_on(p)


async def test_the_selection_checks_above_would_notice_another_strategy() -> None:
    """The control for the two tests above: a different choice on the others is caught."""
    direct()

    async def fn(g: p2pcoll.Group) -> object:
        name = "direct" if g.rank == 0 else "ring"
        return await g.allreduce(np.ones(64, np.float32), strategy=name, timeout=10)

    results = await run_ranks(3, fn, return_exceptions=True)
    for rank, result in enumerate(results):
        assert isinstance(result, p2pcoll.CollectiveMismatch), f"rank {rank}: {result!r}"


# --- unknown names ----------------------------------------------------------------------


def assert_lists_available(err: BaseException) -> None:
    message = str(err)
    assert "nope" in message
    for name in p2pcoll.available_strategies()["allreduce"]:
        assert name in message, f"{name!r} missing from: {message}"


async def test_unknown_strategy_per_call_lists_the_available_ones() -> None:
    direct()

    async def fn(g: p2pcoll.Group) -> np.ndarray:
        with pytest.raises(p2pcoll.UnknownStrategy) as info:
            await g.allreduce(np.ones(4), strategy="nope")
        assert_lists_available(info.value)
        # Nothing was sent: the group is still usable.
        return await g.allreduce(np.ones(4), strategy="direct")

    for result in await run_ranks(2, fn):
        np.testing.assert_array_equal(result, np.full(4, 2.0))


async def test_unknown_strategy_per_group_fails_at_join() -> None:
    with pytest.raises(p2pcoll.UnknownStrategy) as info:
        async with asyncio.timeout(10):
            await run_ranks(2, lambda g: g.barrier(), strategies={"allreduce": "nope"})
    assert_lists_available(info.value)


async def test_unknown_strategy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown name in the environment fails join() at once, before any socket."""
    monkeypatch.setenv("P2PCOLL_ALLREDUCE", "nope")
    with pytest.raises(p2pcoll.UnknownStrategy) as info:
        await p2pcoll.join(world_size=1)
    assert_lists_available(info.value)


# --- register_strategy validation --------------------------------------------------------


@pytest.fixture
def registered() -> Iterator[list[type[Strategy]]]:
    """Strategy classes a test may register; unregistered afterwards whatever happens."""
    classes: list[type[Strategy]] = []
    yield classes
    for cls in classes:
        table = registry.entries().get(getattr(cls, "collective", None), {})
        entry = table.get(getattr(cls, "name", None))
        if entry is not None and type(entry.strategy) is cls:  # never a built-in it clashed with
            registry.unregister(cls.collective, cls.name)


class NotAStrategy:
    name = "not_a_strategy"
    collective = "allreduce"

    def schedule(self, ctx: Context) -> Schedule:
        yield Send((ctx.rank + 1) % ctx.size)


class Nameless(Strategy):
    collective = "allreduce"

    def schedule(self, ctx: Context) -> Schedule:
        yield from ()


def named(name: object, collective: object = "allreduce") -> type[Strategy]:
    return type("Named", (Nameless,), {"name": name, "collective": collective})


class WithoutSchedule(Strategy):
    name = "without_schedule"
    collective = "allreduce"


class OtherRing(Strategy):
    name = "ring"
    collective = "allreduce"

    def schedule(self, ctx: Context) -> Schedule:
        yield from ()


class OtherDirect(OtherRing):
    name = "direct"


@pytest.mark.parametrize(
    ("cls", "problem"),
    [
        (NotAStrategy, r"NotAStrategy.* is not a p2pcoll\.strategy\.Strategy subclass"),
        (Nameless, r"Nameless\.name must be an identifier, got None"),
        (named("two words"), r"name must be an identifier, got 'two words'"),
        (named(""), r"name must be an identifier, got ''"),
        (named(42), r"name must be an identifier, got 42"),
        (named("auto"), r"name must be an identifier, got 'auto'"),
        (named("fine", "alltoallw"), r"collective is 'alltoallw'; expected one of"),
        (named("fine", None), r"collective is None; expected one of"),
        (WithoutSchedule, r"WithoutSchedule does not define schedule\(\)"),
        (OtherRing, r"'ring' .* clashes with the one from p2pcoll .*p2pcoll_plugins\.ring"),
        (OtherDirect, rf"'direct' .* clashes with the one from {DIST}"),
    ],
    ids=["not-a-strategy", "no-name", "spaces", "empty", "int", "auto", "unknown-collective",
         "no-collective", "no-schedule", "clash-builtin", "clash-plugin"],
)
def test_register_strategy_rejects(
    cls: type[Strategy], problem: str, registered: list[type[Strategy]]
) -> None:
    if cls is OtherDirect:
        direct()
    before = {c: dict(t) for c, t in registry.entries().items()}
    registered.append(cls)  # in case it is wrongly accepted
    with pytest.raises(p2pcoll.PluginValidationError, match=problem):
        p2pcoll.register_strategy(cls)
    assert {c: dict(t) for c, t in registry.entries().items()} == before, "registry changed"


class Chain(Strategy):
    """Fold along the chain 0 -> 1 -> ... -> p-1, then pass the result back down it."""

    name = "chain_for_test"
    collective = "allreduce"

    def schedule(self, ctx: Context) -> Schedule:
        r, p = ctx.rank, ctx.size
        if r > 0:
            yield Reduce(r - 1)  # my predecessor's partial sum
        if r < p - 1:
            yield Send(r + 1)  # pass it on ...
            yield Recv(r + 1)  # ... and get the total back
        if r > 0:
            yield Send(r - 1)


async def test_runtime_registered_strategy_works_end_to_end(
    registered: list[type[Strategy]],
) -> None:
    registered.append(Chain)
    assert p2pcoll.register_strategy(Chain) is Chain  # usable as a class decorator
    p2pcoll.register_strategy(Chain)  # the same class again is not a clash
    assert "chain_for_test" in p2pcoll.available_strategies()["allreduce"]
    assert "runtime" in registry.entries()["allreduce"]["chain_for_test"].origin
    for p in (1, 2, 5):
        async def fn(g: p2pcoll.Group) -> np.ndarray:
            return await g.allreduce(inputs(g.world_size, 13)[g.rank], strategy="chain_for_test")

        for result in await run_ranks(p, fn):
            np.testing.assert_array_equal(result, np.sum(inputs(p, 13), axis=0))


# --- schedules are validated by the executor ---------------------------------------------


class _BadOnRankZero(Strategy):
    """Rank 0 yields ``bad(ctx)``; the other ranks wait for a message from rank 0."""

    collective = "allreduce"

    def chunks(self, size: int) -> int:
        return size

    def bad(self, ctx: Context) -> Any:
        raise NotImplementedError

    def schedule(self, ctx: Context) -> Schedule:
        yield self.bad(ctx) if ctx.rank == 0 else Recv(0)


class SendsToItself(_BadOnRankZero):
    name = "sends_to_itself"

    def bad(self, ctx: Context) -> Any:
        return [Send(ctx.rank), Reduce((ctx.rank + 1) % ctx.size)]


class SendsOutOfRange(_BadOnRankZero):
    name = "sends_out_of_range"

    def bad(self, ctx: Context) -> Any:
        return Send(ctx.size)


class ReceivesFromNegative(_BadOnRankZero):
    name = "receives_from_negative"

    def bad(self, ctx: Context) -> Any:
        return Recv(-1)


class ChunkOutOfRange(_BadOnRankZero):
    name = "chunk_out_of_range"

    def bad(self, ctx: Context) -> Any:
        return Send(1, ctx.size)


class RangeOutOfRange(_BadOnRankZero):
    name = "range_out_of_range"

    def bad(self, ctx: Context) -> Any:
        return Send(1, range(0, ctx.size + 1))


class YieldsNotAnOp(_BadOnRankZero):
    name = "yields_not_an_op"

    def bad(self, ctx: Context) -> Any:
        return [Send(1), "recv"]


@pytest.mark.parametrize(
    ("cls", "problem"),
    [
        (SendsToItself, r"Send\(to=0, chunk=ALL\): no such peer"),
        (SendsOutOfRange, r"Send\(to=2, chunk=ALL\): no such peer"),
        (ReceivesFromNegative, r"Recv\(frm=-1, chunk=ALL\): no such peer"),
        (ChunkOutOfRange, r"Send\(to=1, chunk=2\): chunk outside 0\.\.1"),
        (RangeOutOfRange, r"Send\(to=1, chunk=range\(0, 3\)\): chunk outside 0\.\.1"),
        (YieldsNotAnOp, r"yielded 'recv', not Send/Recv/Reduce"),
    ],
    ids=["to-itself", "to-size", "from-minus-one", "chunk", "chunk-range", "not-an-op"],
)
async def test_invalid_schedule_raises_when_used(
    cls: type[Strategy], problem: str, registered: list[type[Strategy]],
) -> None:
    """The rank whose schedule is invalid raises PluginValidationError naming the strategy,
    the rank and the step; the others hear of it at once through the abort."""
    registered.append(cls)
    p2pcoll.register_strategy(cls)

    async def fn(g: p2pcoll.Group) -> object:
        return await g.allreduce(np.ones(8, np.float32), strategy=cls.name, timeout=10)

    start = asyncio.get_running_loop().time()
    mine, theirs = await run_ranks(2, fn, return_exceptions=True)
    assert isinstance(mine, p2pcoll.PluginValidationError), repr(mine)
    assert f"strategy {cls.name!r} (allreduce) on rank 0 of 2 yielded" in str(mine)
    assert re.search(problem, str(mine)), str(mine)
    assert isinstance(theirs, p2pcoll.P2PCollError), repr(theirs)
    assert not isinstance(theirs, p2pcoll.CollectiveTimeout), repr(theirs)
    assert re.search(problem, str(theirs)), str(theirs)
    assert asyncio.get_running_loop().time() - start < 5


class SendsToItselfEverywhere(Strategy):
    name = "sends_to_itself_everywhere"
    collective = "allreduce"

    def schedule(self, ctx: Context) -> Schedule:
        yield Send(ctx.rank)


async def test_invalid_schedule_everywhere_raises_plugin_error_on_every_rank(
    registered: list[type[Strategy]],
) -> None:
    """Every rank's own schedule is invalid, so every rank must raise PluginValidationError.

    Rank 1 runs first, so its abort reaches rank 0 before rank 0 plans its own schedule: the
    failure reported by rank 1 must not turn rank 0's PluginValidationError into a plain
    P2PCollError.
    """
    registered.append(SendsToItselfEverywhere)
    p2pcoll.register_strategy(SendsToItselfEverywhere)

    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 0:
            await asyncio.sleep(0.2)
        return await g.allreduce(np.ones(8, np.float32), strategy=SendsToItselfEverywhere.name,
                                 timeout=10)

    for rank, err in enumerate(await run_ranks(2, fn, return_exceptions=True)):
        assert isinstance(err, p2pcoll.PluginValidationError), f"rank {rank}: {err!r}"
        assert "'sends_to_itself_everywhere' (allreduce) on rank" in str(err)
        assert "no such peer" in str(err)


# --- the architecture rule --------------------------------------------------------------

FORBIDDEN = {"zmq", "numpy", "socket", "asyncio", "time", "msgpack", "pickle", "threading"}


def imports(path: Path) -> Iterator[tuple[str, list[str]]]:
    """(module, names) for every import in ``path``; relative imports resolved to ".mod"."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or ""), [a.name for a in node.names]


PLUGIN_FILES = sorted((ROOT / "plugins").glob("*.py")) + sorted(
    (ROOT / "examples" / "custom_strategy").rglob("*.py")
)


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_the_strategy_api(path: Path) -> None:
    """A plugin sees p2pcoll.strategy and nothing else of p2pcoll: no sockets, no buffers."""
    assert len(PLUGIN_FILES) > 2
    for module, names in imports(path):
        top = module.split(".")[0]
        where = f"{path.relative_to(ROOT)} imports {module} {names or ''}".rstrip()
        if module == "p2pcoll":
            assert names == ["strategy"], f"{where}: only p2pcoll.strategy is allowed"
        elif top == "p2pcoll":
            assert module == "p2pcoll.strategy", f"{where}: only p2pcoll.strategy is allowed"
        assert top not in FORBIDDEN, f"{where}: a strategy is a schedule, not I/O or arithmetic"
        assert not module.startswith(".."), f"{where}: reaches outside its package"
