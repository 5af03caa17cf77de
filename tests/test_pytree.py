"""p2pcoll.pytree: the one leaf order, the treedef on the wire, and leaf paths."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, NamedTuple

import msgpack
import numpy as np
import pytest
import torch  # CI installs the torch extra: the torch tests must not skip

import p2pcoll.types
from p2pcoll.pytree import (
    as_array,
    flatten,
    is_torch_tensor,
    like,
    listed_paths,
    named_leaves,
    replace_leaves,
    unflatten,
)


class Point(NamedTuple):
    x: float
    y: float


def nested() -> dict[str, Any]:
    """Nested dicts, lists and tuples, empty containers among them, keys out of order."""
    return {
        "b": [np.zeros(2), (np.ones((1, 2), np.int8),)],
        "a": {"y": np.full(3, 7.0), "x": []},
        "c": (),
    }


def test_flatten_writes_the_treedef_msgpack_carries_byte_for_byte() -> None:
    leaves, treedef = flatten(nested())
    assert treedef == ["d", [["a", ["d", [["x", ["l", []]], ["y", "*"]]]],
                             ["b", ["l", ["*", ["t", ["*"]]]]],
                             ["c", ["t", []]]]]
    assert msgpack.packb(treedef) == (
        b"\x92\xa1d\x93\x92\xa1a\x92\xa1d\x92\x92\xa1x\x92\xa1l\x90\x92\xa1y\xa1*\x92\xa1b"
        b"\x92\xa1l\x92\xa1*\x92\xa1t\x91\xa1*\x92\xa1c\x92\xa1t\x90"
    )
    assert [leaf.shape for leaf in leaves] == [(3,), (2,), (1, 2)]  # a.y, b.0, b.1.0


def test_flatten_and_named_leaves_share_one_order() -> None:
    tree = nested()
    leaves, _ = flatten(tree)
    named = named_leaves(tree)
    assert [path for path, _ in named] == ["a.y", "b.0", "b.1.0"]
    assert all(a is b for a, b in zip(leaves, (leaf for _, leaf in named), strict=True))


def test_the_order_does_not_depend_on_insertion_order() -> None:
    one = {"w": np.ones(1), "b": {"z": np.zeros(1), "a": np.zeros(2)}}
    two = {"b": {"a": np.zeros(2), "z": np.zeros(1)}, "w": np.ones(1)}
    assert flatten(one)[1] == flatten(two)[1]
    assert [p for p, _ in named_leaves(one)] == [p for p, _ in named_leaves(two)] == [
        "b.a", "b.z", "w"]


def test_keys_are_sorted_level_by_level_and_positions_count_as_numbers() -> None:
    # By key at each level, not by the joined path ("a-b" < "a.x" as strings).
    assert [p for p, _ in named_leaves({"a": {"x": 1.0}, "a-b": 2.0})] == ["a.x", "a-b"]
    # List positions are positions: "10" comes after "9".
    assert [p for p, _ in named_leaves([np.zeros(1)] * 11)][-3:] == ["8", "9", "10"]
    assert [p for p, _ in named_leaves({"blocks": [{"w": 1.0}, (2.0, 3.0)]})] == [
        "blocks.0.w", "blocks.1.0", "blocks.1.1"]


def test_a_bare_leaf() -> None:
    leaves, treedef = flatten(np.arange(3))
    assert treedef == "*" and len(leaves) == 1
    assert [p for p, _ in named_leaves(np.arange(3))] == [""]
    number, _ = flatten(2.5)
    assert isinstance(number[0], np.ndarray) and number[0].shape == () and number[0] == 2.5
    assert unflatten("*", [np.ones(1)]).shape == (1,)


def test_round_trips_keep_the_containers() -> None:
    tree = nested()
    leaves, treedef = flatten(tree)
    back = unflatten(treedef, leaves)
    assert isinstance(back["b"], list) and isinstance(back["b"][1], tuple)
    assert back["a"]["x"] == [] and back["c"] == ()
    assert back["a"]["y"] is tree["a"]["y"]

    copied = replace_leaves(tree, [leaf * 2 for _, leaf in named_leaves(tree)])
    assert list(copied) == ["b", "a", "c"], "replace_leaves keeps the tree's key order"
    assert isinstance(copied["b"], list) and isinstance(copied["b"][1], tuple)
    np.testing.assert_array_equal(copied["a"]["y"], np.full(3, 14.0))
    np.testing.assert_array_equal(copied["b"][1][0], np.full((1, 2), 2, np.int8))

    point_leaves, point_def = flatten(Point(1.0, 2.0))
    assert type(unflatten(point_def, point_leaves)) is tuple, "a namedtuple comes back plain"


@pytest.mark.parametrize("empty", [{}, [], (), {"a": {}, "b": [], "c": ()}, [[], ({},)]])
def test_empty_containers_have_no_leaves(empty: Any) -> None:
    leaves, treedef = flatten(empty)
    assert leaves == [] and named_leaves(empty) == [] and listed_paths(empty) == []
    assert unflatten(treedef, []) == empty
    assert type(unflatten(treedef, [])) is type(empty)
    assert replace_leaves(empty, []) == empty


@pytest.mark.parametrize("bad", [{1: np.zeros(1)}, {"a": {(1, 2): 1.0}}, {1: 1.0, "a": 2.0}])
def test_keys_that_are_not_str_are_refused(bad: Any) -> None:
    for fn in (flatten, named_leaves, listed_paths):
        with pytest.raises(TypeError, match="keys must be str"):
            fn(bad)
    with pytest.raises(TypeError, match="keys must be str"):
        replace_leaves(bad, [np.zeros(1)] * 2)


def test_bad_leaves_are_refused() -> None:
    for fn in (flatten, named_leaves, listed_paths):
        with pytest.raises(TypeError, match=r"'w\.0' is None"):
            fn({"w": [None]})
    with pytest.raises(TypeError, match="at the root is None"):
        flatten(None)
    with pytest.raises(TypeError, match="'x' of type object is not a numeric array"):
        flatten({"x": object()})
    with pytest.raises(ValueError, match=r"both named 'a\.b'"):
        named_leaves({"a": {"b": np.ones(1)}, "a.b": np.ones(1)})


def test_leaf_counts_must_match() -> None:
    tree = {"a": np.ones(1), "b": np.ones(1)}
    _, treedef = flatten(tree)
    with pytest.raises(ValueError, match="more leaves"):
        unflatten(treedef, [np.ones(1)])
    with pytest.raises(ValueError, match="fewer leaves"):
        unflatten(treedef, [np.ones(1)] * 3)
    with pytest.raises(ValueError, match="more leaves"):
        replace_leaves(tree, [])
    with pytest.raises(ValueError, match="fewer leaves"):
        replace_leaves(tree, [1, 2, 3])
    with pytest.raises(ValueError, match="malformed"):
        unflatten(["x", []], [])
    with pytest.raises(ValueError, match="malformed"):
        unflatten(7, [])


def test_listed_paths_follow_insertion_order() -> None:
    tree = {"w": 1.0, "b": {"z": 2.0, "a": 3.0}, "l": [4.0]}
    assert listed_paths(tree) == ["w", "b.z", "b.a", "l.0"]
    assert [p for p, _ in named_leaves(tree)] == ["b.a", "b.z", "l.0", "w"]


def test_the_one_flatten_lives_in_pytree() -> None:
    # p2pcoll.types no longer re-exports it: types -> pytree -> tensors -> types was a circle.
    assert not hasattr(p2pcoll.types, "flatten") and not hasattr(p2pcoll.types, "unflatten")
    assert p2pcoll.pytree.flatten is flatten


# --- torch tensors -----------------------------------------------------------------------------


def test_cpu_torch_tensors_are_leaves_that_share_memory() -> None:
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())     # requires_grad: read through detach()
    leaves, treedef = flatten({"model": params, "step": torch.tensor(3)})
    assert treedef == ["d", [["model", ["d", [["bias", "*"], ["weight", "*"]]]], ["step", "*"]]]
    assert all(isinstance(leaf, np.ndarray) for leaf in leaves)
    leaves[1][0, 0] = 42.0
    assert model.weight[0, 0].item() == 42.0, "flatten gives views of the tensors"

    named = named_leaves(params)
    assert [p for p, _ in named] == ["bias", "weight"]
    assert named[1][1] is model.weight, "named_leaves returns the tensors themselves"
    assert is_torch_tensor(model.weight) and not is_torch_tensor(leaves[1])

    back = like(model.weight, leaves[1])
    assert isinstance(back, torch.Tensor) and back.data_ptr() == model.weight.data_ptr()
    assert like(np.ones(1), leaves[1]) is leaves[1]


def test_torch_sequential_names_match_named_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    nested_params = {"0": {"weight": model[0].weight, "bias": model[0].bias},
                     "2": {"weight": model[2].weight, "bias": model[2].bias}}
    assert {p for p, _ in named_leaves(nested_params)} == {
        name for name, _ in model.named_parameters()}


def test_tensors_off_the_cpu_are_refused() -> None:
    with pytest.raises(TypeError, match="'w' is on meta; move it to the CPU"):
        as_array(torch.empty(2, device="meta"), "w")
    with pytest.raises(TypeError, match="move it to the CPU"):
        flatten({"w": torch.empty(2, device="meta")})


def test_the_pytree_module_never_imports_torch() -> None:
    code = (
        "import sys, numpy as np\n"
        "from p2pcoll.pytree import flatten, named_leaves, is_torch_tensor\n"
        "flatten({'a': np.ones(2), 'b': [1.0]}); named_leaves({'a': np.ones(2)})\n"
        "assert not is_torch_tensor(np.ones(1))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
