"""C-level reads and writes over parallel lists of tensors (a step's parameters, masters,
gradients): one Python call per list, none per tensor and no Python frame of amp's, so a step
costs a constant number of Python calls however many parameters the model has.

`consume(map(setattr, objects, repeat("grad"), values))` sets an attribute pairwise: the
itertools recipe, through a functools.partial of deque, which runs in C.
"""

import collections
import functools
import itertools
import operator

import torch

__all__ = [
    "ADDRESS",
    "GRAD",
    "IS_SPARSE",
    "MARKS",
    "NONES",
    "NOT_NONE",
    "VERSION",
    "address",
    "consume",
    "repeat",
]

GRAD = operator.attrgetter("grad")
IS_SPARSE = operator.attrgetter("is_sparse")
VERSION = operator.attrgetter("_version")
# Where a tensor's data lies: its storage and offset (new data by `param.data = ...` keeps the
# version counter). Not data_ptr, which FakeTensors (device_work's counts) answer with 0 and a
# deprecation warning, and DTensors with 0.
ADDRESS = (torch._C._storage_id, torch.Tensor.storage_offset)
# What marks a tensor as amp last wrote it (rows.py): its version counter, address and shape.
MARKS = (VERSION, *ADDRESS, operator.attrgetter("shape"))
NONES = itertools.repeat(None)  # with map(operator.is_, ...): a C-level "is None" per item
NOT_NONE = functools.partial(operator.is_not, None)  # with filter: no Python call per item


def address(tensor: torch.Tensor) -> tuple[int, int]:
    """ADDRESS's values for one tensor (paths that are not a step's)."""
    return torch._C._storage_id(tensor), tensor.storage_offset()


consume = functools.partial(collections.deque, maxlen=0)  # runs an iterator to its end
repeat = itertools.repeat
