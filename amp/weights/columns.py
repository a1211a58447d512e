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

__all__ = ["GRAD", "IS_SPARSE", "MARKS", "NONES", "NOT_NONE", "VERSION", "consume", "repeat"]

GRAD = operator.attrgetter("grad")
IS_SPARSE = operator.attrgetter("is_sparse")
VERSION = operator.attrgetter("_version")
# What marks a tensor as amp last wrote it (rows.py): its version counter, its data pointer (new
# data by `param.data = ...` keeps the counter), its shape.
MARKS = (VERSION, torch.Tensor.data_ptr, operator.attrgetter("shape"))
NONES = itertools.repeat(None)  # with map(operator.is_, ...): a C-level "is None" per item
NOT_NONE = functools.partial(operator.is_not, None)  # with filter: no Python call per item
consume = functools.partial(collections.deque, maxlen=0)  # runs an iterator to its end
repeat = itertools.repeat
