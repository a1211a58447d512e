"""cast_tree: the tensors nested in a model's inputs and outputs (or custom_fwd's) cast to a dtype."""

import collections
import copy
import dataclasses

import torch

from .casts import CASTABLE

__all__ = ["cast_tree", "CastInputs", "CastOutputs"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def cast_tree(value, dtype, device_filter=None):
    """`value` with every eligible tensor inside it cast to `dtype`: floating, not float64 (the
    rule for model inputs/outputs and custom_fwd), and on a device `device_filter` accepts.

    Tensors may sit in any nesting of tuples, lists, dicts (and other mappings), namedtuples,
    dataclasses, or be objects with a `.to()` method (custom batch types, called with `dtype`).
    Container types are preserved, and an unchanged value is returned as the same object.
    """
    # It runs on a model's inputs and outputs every forward: plain loops, no comprehensions or
    # generators (a Python frame each), and C-level identity checks (the usual classes first,
    # read without a call to isinstance).
    cls = value.__class__
    if cls is tuple:
        items = _cast_items(value, dtype, device_filter)
        return value if items is None else tuple(items)
    if cls is dict and not value:
        return value
    if cls is _Tensor or cls is _Parameter or isinstance(value, _Tensor):
        if value.dtype in CASTABLE and value.dtype is not dtype:
            if device_filter is None or device_filter(value):
                return value.to(dtype)
        return value
    if value is None or isinstance(value, _ATOMS):
        return value
    if isinstance(value, tuple):
        items = _cast_items(value, dtype, device_filter)
        if items is None:
            return value
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, list):
        items = _cast_items(value, dtype, device_filter)
        if items is None:
            return value
        return items if type(value) is list else _rebuild(value, items, list)
    if type(value) is dict and not value:
        return value
    if isinstance(value, collections.abc.Mapping):
        items = {key: cast_tree(item, dtype, device_filter) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return _rebuild_mapping(value, items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _rebuild_dataclass(value, dtype, device_filter)
    if isinstance(value, torch.nn.Module):
        # A module passed as an argument is not data: its own `.to()` would cast its weights.
        return value
    to = getattr(value, "to", None)
    if callable(to):
        return to(dtype)
    return value


_ATOMS = (str, bytes, int, float, bool, torch.dtype)


def _cast_items(values, dtype, device_filter):
    """[cast_tree(value) for each of `values`], or None when every one comes back unchanged."""
    items = None  # made at the first change: no list and no call while nothing changes
    index = -1
    for value in values:
        index += 1
        item = cast_tree(value, dtype, device_filter)
        if item is not value:
            if items is None:
                items = list(values)
            items[index] = item
    return items


def _rebuild_mapping(original, items):
    if type(original) is dict:
        return items
    if isinstance(original, collections.defaultdict):
        new = collections.defaultdict(original.default_factory)
        new.update(items)
        return new
    return _rebuild(original, items, dict)


def _rebuild(original, items, fallback):
    """A container of `original`'s type holding `items` (`fallback` if the type won't build so)."""
    try:
        return type(original)(items)
    except TypeError:
        return fallback(items)


def _rebuild_dataclass(value, dtype, device_filter):
    changes = {}
    for field in dataclasses.fields(value):
        old = getattr(value, field.name)
        new = cast_tree(old, dtype, device_filter)
        if new is not old:
            changes[field.name] = new
    if not changes:
        return value
    new = copy.copy(value)
    for name, item in changes.items():
        object.__setattr__(new, name, item)  # works for frozen dataclasses too
    return new


class CastInputs:
    """Forward pre-hook casting a model's floating inputs (O0/O2/O3; a class, so that a model
    pickles with it)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        return cast_tree(args, self.dtype), (cast_tree(kwargs, self.dtype) if kwargs else kwargs)


class CastOutputs:
    """Forward hook casting a model's floating outputs."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        return cast_tree(output, self.dtype)
