"""p2pcoll.tensors: arrays and CPU torch tensors as the arrays p2pcoll moves, the bfloat16
rule, and the group's collectives on bfloat16 tensors (over the memory transport)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch  # CI installs the torch extra: the torch tests must not skip

import p2pcoll
from p2pcoll import tensors
from p2pcoll.testing import memory_groups


def noise(rank: int, n: int = 301) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randn(n, generator=gen, dtype=torch.float64).to(torch.bfloat16)


# --- conversion ----------------------------------------------------------------------------


def test_a_tensor_is_an_array_over_its_own_memory_any_strides() -> None:
    t = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    a = tensors.as_array(t)
    assert a.shape == (4, 3) and not a.flags.c_contiguous
    np.testing.assert_array_equal(a, t.numpy())
    a[0, 1] = -1.0
    assert t[0, 1].item() == -1.0  # the same memory
    assert tensors.shares(t, a) and not tensors.shares(t, np.ascontiguousarray(a))
    t.resize_(0)  # Tensor.numpy() would have made the storage non-resizable


def test_bfloat16_is_its_bits_only_when_asked() -> None:
    t = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        tensors.as_array(t, "w")
    bits = tensors.as_array(t, bits=True)
    assert bits.dtype == np.int16 and tensors.shares(t, bits)
    np.testing.assert_array_equal(bits, t.view(torch.int16).numpy())
    back = tensors.like(t, bits.copy())
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    assert tensors.result(t, bits) is t  # its own memory: the tensor itself
    with pytest.raises(TypeError, match="bfloat16"):
        p2pcoll.pytree.flatten({"w": t})  # the training layers never see bits as numbers


def test_what_cannot_be_an_array_is_named() -> None:
    with pytest.raises(TypeError, match="meta"):
        tensors.as_array(torch.ones(2, device="meta"), "w")
    with pytest.raises(TypeError, match="layout"):
        tensors.as_array(torch.ones(2, 2).to_sparse())
    with pytest.raises(TypeError, match="None"):
        tensors.as_array(None)
    with pytest.raises(TypeError, match="not a numeric"):
        tensors.as_array(object())


def test_a_lazy_conjugate_reads_its_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j]).conj()
    a = tensors.as_array(z)
    np.testing.assert_array_equal(a, np.array([1 - 2j, 3 + 1j]))
    assert not a.flags.writeable  # a copy: results written there would not reach ``z``


def test_writable_aliases_a_read_only_array() -> None:
    base = np.arange(4.0)
    ro = base[:]
    ro.flags.writeable = False
    w = tensors.writable(ro)
    w[0] = 9.0
    assert base[0] == 9.0 and w.flags.writeable and tensors.writable(base) is base


def test_the_module_never_imports_torch() -> None:
    code = ("import sys, numpy as np\nfrom p2pcoll import tensors\n"
            "assert tensors.as_array(np.ones(1)).shape == (1,)\n"
            "assert not tensors.is_tensor(np.ones(1))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the bfloat16 rule ---------------------------------------------------------------------


def test_narrow_rounds_as_torch_does() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=gen) * 1e3
    x[:3] = torch.tensor([float("inf"), -0.0, 1.00390625])  # 1 + 2**-8: a tie, to even
    ours = tensors.narrow(x.numpy())
    np.testing.assert_array_equal(ours, x.to(torch.bfloat16).view(torch.int16).numpy())
    np.testing.assert_array_equal(tensors.widen(ours), x.to(torch.bfloat16).float().numpy())
    # NaN: c10::BFloat16's quiet NaN (torch's vectorized casts give 0xFFFF, also a NaN)
    assert tensors.narrow(np.array([np.nan], np.float32)).view(np.uint16)[0] == 0x7FC0


def test_the_reduction_of_each_op() -> None:
    half = [torch.ones(2, dtype=torch.bfloat16)]
    assert tensors.reduction("sum", half) == tensors.Reduction(tensors.BFLOAT16["sum"])
    assert tensors.reduction("avg", half) == tensors.Reduction(tensors.BFLOAT16["sum"], True)
    assert tensors.reduction("max", [np.ones(2)]).op is p2pcoll.ReduceOp.MAX
    with pytest.raises(TypeError, match="other dtypes"):
        tensors.reduction("sum", [*half, torch.ones(2)])
    with pytest.raises(TypeError, match="int16 bits"):
        tensors.reduction(p2pcoll.CustomOp("mine", lambda a, b: None), half)


def test_a_sum_rounds_at_every_step() -> None:
    mine = tensors.as_array(torch.tensor([1.0], dtype=torch.bfloat16), bits=True).copy()
    for _ in range(3):  # 1 + 2**-8 three times: each step rounds back to 1 (ties to even)
        tensors.BFLOAT16["sum"].fold(mine, tensors.narrow(np.array([2.0**-8], np.float32)))
    assert tensors.widen(mine)[0] == 1.0


# --- the group's collectives ---------------------------------------------------------------


def run(n: int, fn: Any) -> list[Any]:
    async def main() -> list[Any]:
        groups = await memory_groups(n)
        try:
            return list(await asyncio.gather(*(fn(g) for g in groups)))
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    return asyncio.run(main())


def folded(xs: list[torch.Tensor]) -> torch.Tensor:
    """The sum in rank order, rounded to bfloat16 after every addition."""
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = (acc.float() + x.float()).to(torch.bfloat16)
    return acc


def test_group_allreduce_of_bfloat16_tensors() -> None:
    xs = [noise(r) for r in range(4)]
    once = sum(x.float() for x in xs).to(torch.bfloat16)  # type: ignore[union-attr]
    got = run(4, lambda g: g.allreduce(noise(g.rank), strategy="reduce_broadcast"))
    for r in got:
        assert r.dtype == torch.bfloat16 and torch.equal(r, got[0])
    # reduce_broadcast folds in rank order at rank 0: the sum rounded at every step
    assert torch.equal(got[0], folded(xs)) and not torch.equal(got[0], once)


def test_group_avg_in_place_and_a_pytree_of_tensors() -> None:
    xs = [noise(r) for r in range(3)]
    outs = [noise(r) for r in range(3)]
    got = run(3, lambda g: g.allreduce(outs[g.rank], "avg", out=outs[g.rank],
                                       strategy="reduce_broadcast"))
    assert all(a is b for a, b in zip(got, outs, strict=True))
    want = folded(xs).div_(3)  # a sum, then torch's division, as the torch backend does
    assert all(torch.equal(o, want) for o in outs)
    trees = run(2, lambda g: g.allreduce({"w": torch.ones(2), "n": np.ones(1)}))
    assert isinstance(trees[0]["w"], torch.Tensor) and isinstance(trees[0]["n"], np.ndarray)
    assert torch.equal(trees[0]["w"], torch.full((2,), 2.0))


def test_group_moves_bfloat16_and_refuses_what_it_cannot_do() -> None:
    got = run(2, lambda g: g.broadcast(noise(g.rank), root=1))
    assert all(x.dtype == torch.bfloat16 and torch.equal(x, noise(1)) for x in got)
    parts = run(2, lambda g: g.allgather(noise(g.rank)))
    assert all(torch.equal(p, noise(i)) for i, p in enumerate(parts[0]))

    async def bad(g: p2pcoll.Group) -> list[str]:
        errors = []
        for call in (lambda: g.allreduce([noise(0), torch.ones(301)]),
                     lambda: g.allreduce(noise(0), codec="fp16")):
            with pytest.raises(TypeError) as caught:
                await call()
            errors.append(str(caught.value))
        await g.barrier()  # refused before anything moved: the group is usable
        return errors

    errors = run(2, bad)[0]
    assert "other dtypes" in errors[0] and "bfloat16" in errors[1]
