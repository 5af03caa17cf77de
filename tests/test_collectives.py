"""The correctness matrix: every collective x every installed strategy x ops x dtypes x world
sizes 1..8 x awkward sizes, checked bit for bit against numpy.

Forming a group costs 50-100 ms, so a test forms one group (one collective at one world size)
and walks that collective's whole matrix inside it. Strategies come from
``p2pcoll.available_strategies()``, so a newly installed strategy is covered without edits.

Every rank derives every rank's input from the rank number alone (:func:`data`), so each
computes the expected result with numpy locally. The data is integer-valued and small, so
float sums are exact in any reduction order, products stay within int8, and the expected
result is defined to the bit. A wrong result is recorded with the cell that produced it
("allreduce ring prod int8 strided") and the walk goes on; an exception breaks the group, so
it ends that rank's walk. The test then fails listing every bad cell.

The reductions cover op x dtype x shape kind mostly through pytree calls, one leaf per
(dtype, kind) nested in dicts, lists and tuples: every leaf is chunked on its own, so one
call checks a whole plane of the matrix, and pytrees get tested on the way. Single-array
calls then cover each dtype and each kind once more on the plain path.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import run_ranks

# 1..5 in the default run (powers of two and not, one and two ranks past 4); 6..8 slow.
WORLD_SIZES = [*range(1, 6), *(pytest.param(p, marks=pytest.mark.slow) for p in range(6, 9))]
DTYPES = tuple(
    np.dtype(t) for t in ("uint8", "int8", "int32", "int64", "float16", "float32", "float64")
)
FLOAT32 = np.dtype("float32")
OPS = ("sum", "prod", "min", "max", "avg")
UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
          "max": np.maximum}
BIG = 3 * 2**20 // 4  # 3 MiB of float32: several of the executor's 1 MiB pipeline segments
SEGMENT = 2**20 // 4 + 3  # float32 elements in a bit more than one segment
COLLECTIVE_TIMEOUT = 10.0  # a safety net: a hang fails the test instead of stalling it

Tree = Any


def strategies(collective: str) -> list[str]:
    return p2pcoll.available_strategies()[collective]


def ops_for(dtype: np.dtype[Any]) -> list[str]:
    return [op for op in OPS if op != "avg" or dtype.kind == "f"]


# --- the shapes of the matrix ----------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One awkward size: the shape to generate for world size p, then a view of it."""

    name: str
    shape: Callable[[int], tuple[int, ...]]
    view: Callable[[np.ndarray], np.ndarray] = lambda a: a


KINDS = (
    Kind("empty", lambda p: (0,)),
    Kind("one", lambda p: (1,)),
    Kind("0d", lambda p: ()),
    Kind("fewer_than_p", lambda p: (max(p - 1, 1),)),
    Kind("not_divisible", lambda p: (5 * p + 1,)),
    Kind("strided", lambda p: (2 * (3 * p + 1),), lambda a: a[::2]),
    Kind("transposed", lambda p: (p + 2, 3), lambda a: a.T),
    Kind("rows_fewer_than_p", lambda p: (max(p - 1, 1), 3)),
    Kind("no_rows", lambda p: (0, 4)),
)
KIND = {k.name: k for k in KINDS}
BIG_KIND = Kind("3MiB", lambda p: (BIG,))


def shape_of(kind: Kind, p: int) -> tuple[int, ...]:
    return kind.view(np.empty(kind.shape(p), np.uint8)).shape


def per_rank_big(p: int) -> Kind:
    """For allgather/gather/scatter: about 3 MiB in all, but each part over one segment."""
    return Kind("big_parts", lambda _: (max(BIG // p, SEGMENT),))


# --- every rank's input, and the expected results -------------------------------------------


@functools.cache
def _values(rank: int, shape: tuple[int, ...], dtype: np.dtype[Any], op: str,
            salt: int) -> np.ndarray:
    """Small integers that depend on the rank, the element and the cell (``salt``).

    Sums of up to 8 ranks stay within int8/uint8 and are exact in float16; for "prod" each
    element has at most two factors 2 (and some -1) over 8 ranks, so no product overflows.
    """
    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n, dtype=np.int64) + 5 * salt
    signed = dtype.kind != "u"
    if op == "prod":
        v = np.where((i + rank) % 4 == 0, 2, 1)
        if signed:
            v = np.where((i + 3 * rank) % 5 == 0, -v, v)
    else:
        v = (3 * i + 5 * rank) % 11
        if signed:
            v = v - 5
    out = v.astype(dtype).reshape(shape)
    out.flags.writeable = False
    return out


def data(rank: int, kind: Kind, p: int, dtype: np.dtype[Any], op: str = "sum",
         salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input for one cell: a fresh writable array, non-contiguous if the kind
    says so."""
    return kind.view(_values(rank, kind.shape(p), dtype, op, salt).copy())


@functools.cache
def reduced(kind: Kind, p: int, dtype: np.dtype[Any], op: str, salt: int) -> np.ndarray:
    """The reduction over ranks 0..p-1 of :func:`data`, folded in the dtype as numpy would."""
    acc = np.array(data(0, kind, p, dtype, op, salt), copy=True)
    for rank in range(1, p):
        UFUNCS[op](acc, data(rank, kind, p, dtype, op, salt), out=acc)
    if op == "avg":
        np.divide(acc, p, out=acc)
    acc.flags.writeable = False
    return acc


def clear_caches() -> None:
    _values.cache_clear()
    reduced.cache_clear()


def tree_of(leaf: Callable[[np.dtype[Any], Kind], np.ndarray],
            dtypes: Sequence[np.dtype[Any]]) -> Tree:
    """A pytree with one leaf per (dtype, kind), nested in dicts, lists and tuples."""
    return {
        "by_dtype": {d.name: {k.name: leaf(d, k) for k in KINDS} for d in dtypes},
        "nested": [
            (leaf(dtypes[-1], KIND["one"]), [leaf(dtypes[0], KIND["0d"])]),
            {"z": leaf(dtypes[0], KIND["not_divisible"])},
        ],
    }


def leaves(tree: Tree) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in leaves(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in leaves(item)]
    return [tree]


def copy_tree(tree: Tree) -> Tree:
    if isinstance(tree, dict):
        return {k: copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(copy_tree(v) for v in tree)
    return np.array(tree, copy=True)


# --- collecting failures --------------------------------------------------------------------


@dataclass
class Report:
    """What one rank saw while walking the matrix."""

    rank: int
    cell: str = "(before the first cell)"
    failures: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)  # cell -> hash of the result

    def at(self, cell: str) -> None:
        """Name the cell about to run (an exception from it is reported under this name)."""
        self.cell = cell

    def fail(self, message: str, where: str = "") -> None:
        self.failures.append(f"rank {self.rank}: {self.cell}{where}: {message}")

    def array(self, got: object, want: np.ndarray, where: str = "") -> None:
        """Record a failure unless ``got`` has ``want``'s dtype, shape and bytes."""
        if not isinstance(got, np.ndarray):
            self.fail(f"returned {type(got).__name__}, not an ndarray", where)
        elif got.dtype != want.dtype or got.shape != want.shape:
            self.fail(f"returned {got.dtype}{got.shape}, expected {want.dtype}{want.shape}", where)
        elif got.tobytes() != want.tobytes():
            bad = np.flatnonzero(np.ascontiguousarray(got).reshape(-1).view(np.uint8)
                                 != np.ascontiguousarray(want).reshape(-1).view(np.uint8))
            element = int(bad[0]) // want.itemsize
            self.fail(f"wrong values from element {element}: got "
                      f"{got.reshape(-1)[element:element + 4]}, expected "
                      f"{want.reshape(-1)[element:element + 4]}", where)

    def tree(self, got: Tree, want: Tree, where: str = "") -> None:
        """Like :meth:`array`, over a pytree whose containers must match too."""
        if isinstance(want, (dict, list, tuple)):
            if type(got) is not type(want):
                self.fail(f"returned a {type(got).__name__}, expected a {type(want).__name__}",
                          where)
            elif isinstance(want, dict) and sorted(got) != sorted(want):
                self.fail(f"returned keys {sorted(got)}, expected {sorted(want)}", where)
            elif len(got) != len(want):
                self.fail(f"returned {len(got)} items, expected {len(want)}", where)
            elif isinstance(want, dict):
                for key in want:
                    self.tree(got[key], want[key], f"{where}[{key!r}]")
            else:
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    self.tree(g, w, f"{where}[{i}]")
        else:
            self.array(got, want, where)

    def unchanged(self, now: Tree, before: Tree) -> None:
        """The input must not have been modified."""
        n = len(self.failures)
        self.tree(now, before)
        if len(self.failures) > n:
            self.failures[n:] = [f + " (the INPUT was modified)" for f in self.failures[n:]]

    def digest(self, result: Tree) -> None:
        """Remember the result's bits, to compare across ranks."""
        h = hashlib.blake2b(digest_size=16)
        for leaf in leaves(result):
            a = np.asarray(leaf)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        self.digests[self.cell] = h.hexdigest()


Walk = Callable[[p2pcoll.Group, Report], Awaitable[None]]


async def run_matrix(p: int, *walks: Walk, **join_kwargs: Any) -> None:
    """Form one group of ``p`` peers, walk the matrices on every rank, fail with all bad cells.

    Also asserts that every rank got the same bits wherever a walk recorded a digest.
    """

    async def rank_main(g: p2pcoll.Group) -> Report:
        report = Report(g.rank)
        try:
            for walk in walks:
                await walk(g, report)
        except Exception as exc:
            report.fail(f"raised {type(exc).__name__}: {exc}")
        return report

    try:
        reports = await run_ranks(p, rank_main, collective_timeout=COLLECTIVE_TIMEOUT,
                                  **join_kwargs)
    finally:
        clear_caches()
    failures = [f for r in reports for f in r.failures]
    for cell, digest in reports[0].digests.items():
        differ = [r.rank for r in reports[1:] if r.digests.get(cell) != digest]
        if differ:
            failures.append(f"{cell}: ranks {differ} got other bits than rank 0")
    if failures:
        more = f"\n... and {len(failures) - 60} more" if len(failures) > 60 else ""
        pytest.fail(f"{len(failures)} failures:\n" + "\n".join(failures[:60]) + more,
                    pytrace=False)


# --- the walks, one per collective -------------------------------------------------------------


async def walk_allreduce(g: p2pcoll.Group, report: Report) -> None:
    p, rank = g.world_size, g.rank
    salt = 0
    for s in strategies("allreduce"):
        # The op x dtype x kind planes, as pytrees (the op also given as a ReduceOp once).
        for op in OPS:
            salt += 1
            dtypes = [d for d in DTYPES if op in ops_for(d)]
            mine = tree_of(lambda d, k: data(rank, k, p, d, op, salt), dtypes)
            before = copy_tree(mine)
            report.at(f"allreduce {s} {op} pytree of {len(dtypes)} dtypes x {len(KINDS)} kinds")
            got = await g.allreduce(mine, p2pcoll.ReduceOp(op) if salt == 1 else op, strategy=s)
            report.tree(got, tree_of(lambda d, k: reduced(k, p, d, op, salt), dtypes))
            report.unchanged(mine, before)
            report.digest(got)
        # Single arrays: every dtype (ops in turn), then every kind (with its own op).
        cells = [(d, KIND["not_divisible"], ops_for(d)[i % len(ops_for(d))])
                 for i, d in enumerate(DTYPES)]
        cells += [(DTYPES[(i + 2) % len(DTYPES)], k, OPS[i % 4]) for i, k in enumerate(KINDS)]
        cells += [(FLOAT32, BIG_KIND, "sum")]
        for d, k, op in cells:
            salt += 1
            mine = data(rank, k, p, d, op, salt)
            before = mine.copy()
            report.at(f"allreduce {s} {op} {d} {k.name}")
            got = await g.allreduce(mine, op, strategy=s)
            report.array(got, reduced(k, p, d, op, salt))
            report.unchanged(mine, before)
            report.digest(got)
    await check_avg_rejects_integers(g, report, "allreduce")


async def walk_reduce(g: p2pcoll.Group, report: Report) -> None:
    p, rank = g.world_size, g.rank
    salt = 0
    for s in strategies("reduce"):
        for op in OPS:
            salt += 1
            root = (salt + 1) % p
            dtypes = [d for d in DTYPES if op in ops_for(d)]
            mine = tree_of(lambda d, k: data(rank, k, p, d, op, salt), dtypes)
            report.at(f"reduce {s} {op} root={root} pytree of {len(dtypes)} dtypes")
            got = await g.reduce(mine, root=root, op=op, strategy=s)
            if rank == root:
                report.tree(got, tree_of(lambda d, k: reduced(k, p, d, op, salt), dtypes))
            elif got is not None:
                report.fail(f"a non-root got {type(got).__name__}, expected None")
        cells = [(d, KIND["not_divisible"], ops_for(d)[i % len(ops_for(d))])
                 for i, d in enumerate(DTYPES)]
        cells += [(DTYPES[(i + 3) % len(DTYPES)], k, OPS[i % 4]) for i, k in enumerate(KINDS)]
        cells += [(FLOAT32, BIG_KIND, "sum")]
        for d, k, op in cells:
            salt += 1
            root = salt % p
            report.at(f"reduce {s} {op} {d} {k.name} root={root}")
            got = await g.reduce(data(rank, k, p, d, op, salt), root=root, op=op, strategy=s)
            if rank == root:
                report.array(got, reduced(k, p, d, op, salt))
            elif got is not None:
                report.fail(f"a non-root got {type(got).__name__}, expected None")
    await check_avg_rejects_integers(g, report, "reduce")


async def walk_reduce_scatter(g: p2pcoll.Group, report: Report) -> None:
    """Rank r must get ``np.array_split(total, p, axis=0)[r]``, even with fewer rows than p."""
    p, rank = g.world_size, g.rank
    rows = Kind("2d_not_divisible", lambda p: (2 * p + 1, 3))
    salt = 0
    for s in strategies("reduce_scatter"):
        cells = [(d, rows, op) for d in DTYPES for op in ops_for(d)]
        cells += [(DTYPES[(i + 1) % len(DTYPES)], k, OPS[i % 4])
                  for i, k in enumerate(KINDS) if k.name != "0d"]
        cells += [(FLOAT32, BIG_KIND, "sum")]
        for d, k, op in cells:
            salt += 1
            report.at(f"reduce_scatter {s} {op} {d} {k.name}")
            got = await g.reduce_scatter(data(rank, k, p, d, op, salt), op, strategy=s)
            report.array(got, np.array_split(reduced(k, p, d, op, salt), p, axis=0)[rank])
        report.at(f"reduce_scatter {s} of a 0-d array must raise ValueError (no axis 0)")
        await expect_value_error(report, g.reduce_scatter(np.array(1.0, np.float32), strategy=s))
    await check_avg_rejects_integers(g, report, "reduce_scatter")


async def check_avg_rejects_integers(g: p2pcoll.Group, report: Report, collective: str) -> None:
    """``avg`` on an integer dtype is a ValueError before anything is sent, so the group
    stays usable (the next collective must still work)."""
    call = getattr(g, collective)
    for d in DTYPES:
        if d.kind != "f":
            report.at(f"{collective} avg {d} must raise ValueError")
            await expect_value_error(report, call(np.ones(3, d), op="avg"), mentioning="avg")
    if collective != "reduce_scatter":
        report.at(f"{collective} avg of a pytree with one integer leaf must raise ValueError")
        mixed = {"f": np.ones(2, np.float32), "i": np.ones(2, np.int32)}
        await expect_value_error(report, call(mixed, op="avg"), mentioning="avg")
    report.at(f"{collective} sum after the rejected avg calls")
    got = await call(np.ones(3, np.int32), op="sum")
    if collective == "reduce_scatter":
        report.array(got, np.array_split(np.full(3, g.world_size, np.int32), g.world_size)[g.rank])
    elif collective == "allreduce" or g.rank == 0:
        report.array(got, np.full(3, g.world_size, np.int32))


async def expect_value_error(report: Report, call: Awaitable[object], mentioning: str = "") -> None:
    try:
        await call
    except ValueError as exc:
        if mentioning not in str(exc):
            report.fail(f"the ValueError does not mention {mentioning!r}: {exc}")
    else:
        report.fail("no ValueError")


async def walk_broadcast(g: p2pcoll.Group, report: Report) -> None:
    """Any root; non-roots pass None or a preallocated buffer, filled in place and returned."""
    p, rank = g.world_size, g.rank
    salt = 0
    for s in strategies("broadcast"):
        cells = [(d, KIND["not_divisible"]) for d in DTYPES]
        cells += [(DTYPES[(i + 4) % len(DTYPES)], k) for i, k in enumerate(KINDS)]
        cells += [(FLOAT32, BIG_KIND)]
        for d, k in cells:
            salt += 1
            root = salt % p
            use_buffer = salt % 2 == 0
            want = data(root, k, p, d, salt=salt)
            report.at(f"broadcast {s} {d} {k.name} root={root} "
                      f"non-roots pass {'a buffer' if use_buffer else 'None'}")
            if rank == root:
                mine = data(rank, k, p, d, salt=salt)
                got = await g.broadcast(mine, root=root, strategy=s)
                report.unchanged(mine, want)
            elif use_buffer:
                buf = np.empty(want.shape, d)
                got = await g.broadcast(buf, root=root, strategy=s)
                if got is not buf:
                    report.fail("returned a new array instead of the buffer passed in")
                report.array(buf, want, " (the buffer)")
            else:
                got = await g.broadcast(None, root=root, strategy=s)
            report.array(got, want)
            report.digest(got)
        for use_buffer in (False, True):
            salt += 1
            root = (p - 1 + salt) % p
            want = tree_of(lambda d, k: data(root, k, p, d, salt=salt), DTYPES)
            report.at(f"broadcast {s} pytree root={root} "
                      f"non-roots pass {'buffers' if use_buffer else 'None'}")
            if rank == root:
                got = await g.broadcast(copy_tree(want), root=root, strategy=s)
            elif use_buffer:
                bufs = tree_of(lambda d, k: np.empty(shape_of(k, p), d), DTYPES)
                got = await g.broadcast(bufs, root=root, strategy=s)
                if not all(a is b for a, b in zip(leaves(got), leaves(bufs), strict=False)):
                    report.fail("returned new arrays instead of the buffers passed in")
                report.tree(bufs, want, " (the buffers)")
            else:
                got = await g.broadcast(None, root=root, strategy=s)
            report.tree(got, want)
            report.digest(got)


async def walk_allgather(g: p2pcoll.Group, report: Report) -> None:
    p, rank = g.world_size, g.rank
    salt = 0
    for s in strategies("allgather"):
        cells = [(d, KIND["not_divisible"]) for d in DTYPES]
        cells += [(DTYPES[(i + 5) % len(DTYPES)], k) for i, k in enumerate(KINDS)]
        cells += [(FLOAT32, per_rank_big(p))]
        for d, k in cells:
            salt += 1
            report.at(f"allgather {s} {d} {k.name}")
            mine = data(rank, k, p, d, salt=salt)
            got = await g.allgather(mine, strategy=s)
            report.tree(got, [data(r, k, p, d, salt=salt) for r in range(p)])
            report.unchanged(mine, data(rank, k, p, d, salt=salt))
            report.digest(got)


async def walk_gather(g: p2pcoll.Group, report: Report) -> None:
    p, rank = g.world_size, g.rank
    salt = 0
    for s in strategies("gather"):
        cells = [(d, KIND["not_divisible"]) for d in DTYPES]
        cells += [(DTYPES[(i + 6) % len(DTYPES)], k) for i, k in enumerate(KINDS)]
        cells += [(FLOAT32, per_rank_big(p))]
        for d, k in cells:
            salt += 1
            root = (2 * salt) % p
            report.at(f"gather {s} {d} {k.name} root={root}")
            got = await g.gather(data(rank, k, p, d, salt=salt), root=root, strategy=s)
            if rank == root:
                report.tree(got, [data(r, k, p, d, salt=salt) for r in range(p)])
            elif got is not None:
                report.fail(f"a non-root got {type(got).__name__}, expected None")


async def walk_scatter(g: p2pcoll.Group, report: Report) -> None:
    """The root's parts may differ in shape from rank to rank."""
    p, rank = g.world_size, g.rank
    ragged = [Kind(f"{r}x{r % 3 + 1}", lambda _, r=r: (r, r % 3 + 1)) for r in range(p)]
    shapes: list[tuple[str, Callable[[int], Kind]]] = [
        ("ragged_1d", lambda r: Kind(f"{2 * r + 1}", lambda _: (2 * r + 1,))),
        ("ragged_2d_some_empty", lambda r: ragged[r]),
        ("0d", lambda r: KIND["0d"]),
        ("strided_or_transposed", lambda r: KIND["strided" if r % 2 else "transposed"]),
        ("big_parts", lambda r: per_rank_big(p)),
    ]
    salt = 0
    for s in strategies("scatter"):
        cells = [(d, shapes[0]) for d in DTYPES]
        cells += [(DTYPES[(i + 2) % len(DTYPES)], shape) for i, shape in enumerate(shapes)]
        for d, (name, kind_of) in cells:
            salt += 1
            root = (salt + 3) % p
            report.at(f"scatter {s} {d} {name} root={root}")
            parts = [data(r, kind_of(r), p, d, salt=salt) for r in range(p)]
            got = await g.scatter(parts if rank == root else None, root=root, strategy=s)
            report.array(got, data(rank, kind_of(rank), p, d, salt=salt))


async def walk_alltoall(g: p2pcoll.Group, report: Report) -> None:
    """Rank i's part j reaches rank j; lengths differ per pair (some zero), parts may be
    2-d or strided views, or each over a segment."""
    p, rank = g.world_size, g.rank

    def part(i: int, j: int, shape: str) -> Kind:
        n = (i + 2 * j) % 4
        if shape == "2d":
            return Kind(f"{n}x3", lambda _: (n, 3))
        if shape == "strided":
            return Kind(f"{n}, strided", lambda _: (2 * n,), lambda a: a[::2])
        return per_rank_big(p) if shape == "big" else Kind(f"{n}", lambda _: (n,))

    salt = 0
    for s in strategies("alltoall"):
        cells = [(d, "1d") for d in DTYPES]
        cells += [(DTYPES[i], shape) for i, shape in enumerate(("2d", "strided"))]
        cells += [(FLOAT32, "big")]
        for d, shape in cells:
            salt += 1
            report.at(f"alltoall {s} {d} {shape}")
            got = await g.alltoall([data(rank, part(rank, j, shape), p, d, salt=16 * salt + j)
                                    for j in range(p)], strategy=s)
            report.tree(got, [data(i, part(i, rank, shape), p, d, salt=16 * salt + rank)
                              for i in range(p)])


async def walk_barrier(
    g: p2pcoll.Group, report: Report, arrived: dict[tuple[str, int], set[int]]
) -> None:
    """Nobody leaves a barrier before everyone has entered it (ranks arrive staggered)."""
    p, rank = g.world_size, g.rank
    for s in strategies("barrier"):
        for round_ in range(3):
            key = (s, round_)
            await asyncio.sleep(0.002 * ((rank + round_) % p))
            arrived.setdefault(key, set()).add(rank)
            report.at(f"barrier {s} round {round_}")
            await g.barrier(strategy=s)
            missing = set(range(p)) - arrived[key]
            if missing:
                report.fail(f"left the barrier before ranks {sorted(missing)} entered it")


def barrier_walk() -> Walk:
    arrived: dict[tuple[str, int], set[int]] = {}  # shared by the ranks of one group (one process)
    return functools.partial(walk_barrier, arrived=arrived)


WALKS: dict[str, Callable[[], Walk]] = {
    "broadcast": lambda: walk_broadcast,
    "reduce": lambda: walk_reduce,
    "allreduce": lambda: walk_allreduce,
    "allgather": lambda: walk_allgather,
    "reduce_scatter": lambda: walk_reduce_scatter,
    "gather": lambda: walk_gather,
    "scatter": lambda: walk_scatter,
    "barrier": barrier_walk,
    "alltoall": lambda: walk_alltoall,
}


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("collective", list(WALKS))
async def test_matrix(collective: str, p: int) -> None:
    await run_matrix(p, WALKS[collective]())


@pytest.mark.parametrize("transport", [
    "tcp", pytest.param("ipc", marks=pytest.mark.slow), "inproc"])
async def test_matrix_over_transport(transport: str) -> None:
    """The whole matrix at one world size over each transport forced, in one group each
    (the other tests use the default, auto: ipc between peers of one host, so the ipc
    pass, which repeats test_matrix at p = 4, is in the slow tier)."""
    await run_matrix(4, *(make() for make in WALKS.values()), transport=transport)


def test_every_collective_has_a_walk_and_a_strategy() -> None:
    """A new collective must be added to the matrix; each has at least one strategy."""
    available = p2pcoll.available_strategies()
    assert set(WALKS) == set(available)
    assert all(available[c] for c in WALKS), available
