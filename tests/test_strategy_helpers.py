"""The renumbering helpers of the strategy API: ``Context.relative``/``real`` and ``Fold``."""

from __future__ import annotations

import pytest

import p2pcoll.strategy as api
from p2pcoll.strategy import Context, Fold, Recv, Reduce, Send, largest_power_of_two

SIZES = range(1, 34)


def test_helpers_are_exported() -> None:
    for name in ("Context", "Fold", "largest_power_of_two"):
        assert name in api.__all__
    for documented in ("``ctx.relative``", "``Fold(ctx)``", "``largest_power_of_two(n)``"):
        assert documented in (api.__doc__ or ""), f"the module docstring lacks {documented}"


# --- root-relative renumbering -------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_relative_and_real_are_inverse_bijections(size: int) -> None:
    for root in range(size):
        relative = [Context(rank, size, root).relative for rank in range(size)]
        assert sorted(relative) == list(range(size)), f"size {size}, root {root}"
        assert Context(root, size, root).relative == 0  # the root is relative rank 0
        for rank in range(size):
            ctx = Context(rank, size, root)
            assert ctx.real(ctx.relative) == rank
            assert ctx.relative == (rank - root) % size
            for q in range(size):
                assert Context(ctx.real(q), size, root).relative == q


def test_relative_example_from_the_docstring() -> None:
    assert [Context(rank, 5, 3).relative for rank in (3, 4, 0, 1, 2)] == [0, 1, 2, 3, 4]


def test_real_wraps_around() -> None:
    ctx = Context(rank=2, size=5, root=2)
    assert ctx.real(-1) == 1  # the predecessor of the root in a chain
    assert ctx.real(5) == 2
    assert ctx.real(4) == 1


# --- largest_power_of_two ------------------------------------------------------------------


def test_largest_power_of_two() -> None:
    assert [largest_power_of_two(n) for n in range(1, 18)] == (
        [1, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 8, 8, 8, 8, 16, 16]
    )
    for bad in (0, -3):
        with pytest.raises(ValueError, match="n >= 1"):
            largest_power_of_two(bad)


# --- the MPICH fold ------------------------------------------------------------------------


def test_fold_example_from_the_docstring() -> None:
    folds = [Fold(Context(rank, 6)) for rank in range(6)]
    assert {f.pof2 for f in folds} == {4} and {f.extra for f in folds} == {2}
    assert [f.newrank for f in folds] == [None, 0, None, 1, 2, 3]
    assert [list(f.fold_in()) for f in folds] == [
        [Send(1)], [Reduce(0)], [Send(3)], [Reduce(2)], [], [],
    ]
    assert [list(f.fold_out()) for f in folds] == [
        [Recv(1)], [Send(0)], [Recv(3)], [Send(2)], [], [],
    ]


@pytest.mark.parametrize("size", SIZES)
def test_fold_renumbers_onto_the_largest_power_of_two(size: int) -> None:
    folds = [Fold(Context(rank, size, root=size - 1)) for rank in range(size)]  # root unused
    pof2 = largest_power_of_two(size)
    assert all(f.pof2 == pof2 and f.extra == size - pof2 for f in folds)
    core = {rank: f.newrank for rank, f in enumerate(folds) if f.newrank is not None}
    # The core is exactly pof2 ranks, numbered 0..pof2-1, and real() is the inverse.
    assert sorted(core.values()) == list(range(pof2))
    for rank, newrank in core.items():
        assert folds[rank].real(newrank) == rank
    # Those that sit out are the even ranks below 2 * extra.
    extra = size - pof2
    assert sorted(set(range(size)) - set(core)) == list(range(0, 2 * extra, 2))


@pytest.mark.parametrize("size", SIZES)
def test_fold_in_and_out_pair_up(size: int) -> None:
    """Every send of the fold meets a receive from the same partner, and only the first
    2 * extra ranks take part; a power of two folds nothing."""
    pof2 = largest_power_of_two(size)
    for phase in ("fold_in", "fold_out"):
        steps = {rank: list(getattr(Fold(Context(rank, size)), phase)()) for rank in range(size)}
        sends = {(rank, s.to) for rank, ops in steps.items() for s in ops if isinstance(s, Send)}
        recvs = {(s.frm, rank) for rank, ops in steps.items() for s in ops
                 if isinstance(s, (Recv, Reduce))}
        assert sends == recvs, f"{phase}, size {size}"
        busy = sorted(rank for rank, ops in steps.items() if ops)
        assert busy == list(range(2 * (size - pof2))), f"{phase}, size {size}"
        assert all(len(ops) <= 1 for ops in steps.values())
        # In fold_in the data goes up and is reduced; in fold_out the result comes back down.
        for rank, ops in steps.items():
            for op in ops:
                if phase == "fold_in":
                    assert op in (Send(rank + 1), Reduce(rank - 1))
                else:
                    assert op in (Send(rank - 1), Recv(rank + 1))


def test_fold_is_a_value() -> None:
    assert Fold(Context(3, 7)) == Fold(Context(3, 7))
    with pytest.raises(AttributeError):
        Fold(Context(3, 7)).ctx = Context(0, 7)  # type: ignore[misc]
