"""Casting nested values (amp/casting/cast_tree.py): cast_tree keeps container types and returns
what it did not change as the same objects."""

import collections

import torch

from amp.casting.cast_tree import cast_tree
from helpers.models import Batch, FrozenBatch, Movable, Pair


def test_cast_tree_preserves_container_types():
    f, i, d = torch.randn(2), torch.arange(2), torch.randn(2, dtype=torch.float64)
    tree = {
        "tuple": (f, i),
        "list": [f, [f, "text"]],
        "named": Pair(f, i),
        "ordered": collections.OrderedDict(a=f),
        "default": collections.defaultdict(list, a=f),
        "batch": Batch(f, i),
        "frozen": FrozenBatch(f),
        "movable": Movable(f),
        "double": d,
        "module": torch.nn.Linear(2, 2),
        "none": None,
    }
    cast = cast_tree(tree, torch.float16)
    assert type(cast) is dict
    assert type(cast["tuple"]) is tuple and cast["tuple"][0].dtype is torch.float16
    assert cast["tuple"][1] is i  # integers untouched
    assert (
        type(cast["list"]) is list
        and cast["list"][1][0].dtype is torch.float16
        and cast["list"][1][1] == "text"
    )
    assert type(cast["named"]) is Pair and cast["named"].first.dtype is torch.float16
    assert (
        type(cast["ordered"]) is collections.OrderedDict
        and cast["ordered"]["a"].dtype is torch.float16
    )
    assert (
        type(cast["default"]) is collections.defaultdict and cast["default"].default_factory is list
    )
    assert type(cast["batch"]) is Batch and cast["batch"].image.dtype is torch.float16
    assert cast["batch"].label is i and cast["batch"].note == "x"
    assert (
        cast["frozen"].image.dtype is torch.float16 and tree["frozen"].image.dtype is torch.float32
    )
    assert cast["movable"].tensor.dtype is torch.float16
    assert cast["double"] is d  # float64 is asked for deliberately
    assert cast["module"] is tree["module"] and tree["module"].weight.dtype is torch.float32


def test_cast_tree_returns_unchanged_values_as_the_same_objects():
    tree = ([torch.arange(3)], {"a": torch.randn(2, dtype=torch.float16)})
    assert cast_tree(tree, torch.float16) is tree
