"""C-level reads and writes over parallel lists of tensors (a step's parameters, masters,
gradients): one Python call per list, none per tensor, so a step costs a constant number of
Python calls however many parameters the model has."""

import collections
import functools
import itertools
import operator

__all__ = ["GRAD", "IS_SPARSE", "NONES", "NOT_NONE", "set_each"]

GRAD = operator.attrgetter("grad")
IS_SPARSE = operator.attrgetter("is_sparse")
NONES = itertools.repeat(None)  # with map(operator.is_, ...): a C-level "is None" per item
NOT_NONE = functools.partial(operator.is_not, None)  # with filter: no Python call per item


def set_each(objects, name, values):
    """setattr(object, name, value) pairwise at C level: no Python frame per object."""
    collections.deque(map(setattr, objects, itertools.repeat(name), values), maxlen=0)
