"""Cast policies, the weight-cast cache, and casting of tensors nested in arbitrary containers."""

import collections
import copy
import dataclasses
import functools
import weakref

import torch

from ._state import amp_state

LOW_PRECISION = frozenset((torch.float16, torch.bfloat16))
# float64 is never cast: it is asked for deliberately (torch.amp's rule).
CASTABLE = frozenset((torch.float16, torch.bfloat16, torch.float32))
DEVICE_TYPES = ("cpu", "cuda")


def _is_cuda(tensor):
    return tensor.is_cuda


def _is_cpu(tensor):
    return tensor.is_cpu


class CastPolicy:
    """What is cast, and to what, while the policy is in force.

    `dtype` is the low-precision type; `device_type` limits casting to tensors on that device
    (None: every device); `cache_enabled` allows reuse of weight casts through the cache.
    """

    __slots__ = ("dtype", "device_type", "cache_enabled", "device_filter", "to_low_sources")

    def __init__(self, dtype, device_type=None, cache_enabled=True):
        self.dtype = dtype
        self.device_type = device_type
        self.cache_enabled = cache_enabled
        self.device_filter = {None: None, "cuda": _is_cuda, "cpu": _is_cpu}[device_type]
        self.to_low_sources = CASTABLE - {dtype}

    def __repr__(self):
        return (
            f"CastPolicy(dtype={self.dtype}, device_type={self.device_type!r}, "
            f"cache_enabled={self.cache_enabled})"
        )


@functools.lru_cache(maxsize=None)
def policy_for(dtype, device_type=None, cache_enabled=True):
    """Policies are immutable; share one object per configuration."""
    return CastPolicy(dtype, device_type, cache_enabled)


class WeightCastCache:
    """Low-precision copies of FP32 leaf tensors (weights), reused within one iteration.

    An entry is keyed by the weight and the target dtype, and is served only while the weight's
    version counter and storage are unchanged, so an in-place update (an optimizer step, an EMA
    swap, `param.copy_`) or a `param.data = ...` swap is never answered with a stale cast.
    Writes through `param.data` bypass the version counter; amp clears the cache after every
    optimizer step it drives, at `scale_loss` exit and when the outermost autocast region exits.
    """

    def __init__(self):
        self._entries = {}

    def __len__(self):
        return len(self._entries)

    def get(self, tensor, dtype):
        key = (id(tensor), dtype)
        entry = self._entries.get(key)
        if entry is not None:
            ref, version, data_ptr, cast = entry
            if ref() is tensor and tensor._version == version and tensor.data_ptr() == data_ptr:
                return cast
        if torch.is_grad_enabled():
            cast = tensor.to(dtype)
        elif torch.is_inference_mode_enabled():
            return tensor.to(dtype)  # inference tensors cannot join a graph later: not kept
        else:
            # Cast with grad on, so that a cast made under no_grad (an eval pass) is still a
            # valid autograd edge when training resumes (the bug behind pytorch/pytorch#158232).
            with torch.enable_grad():
                cast = tensor.to(dtype)
        self._entries[key] = (weakref.ref(tensor), tensor._version, tensor.data_ptr(), cast)
        return cast

    def clear(self):
        self._entries.clear()


amp_state.cast_cache = WeightCastCache()


def should_cast_to(tensor, dtype, device_filter=None):
    """The eligibility rule for model inputs/outputs and custom_fwd: floating, not float64."""
    return (
        tensor.dtype in CASTABLE
        and tensor.dtype is not dtype
        and (device_filter is None or device_filter(tensor))
    )


def cast_tree(value, dtype, device_filter=None):
    """`value` with every eligible tensor inside it cast to `dtype`.

    Tensors may sit in any nesting of tuples, lists, dicts (and other mappings), namedtuples,
    dataclasses, or be objects with a `.to()` method (custom batch types, called with `dtype`).
    Container types are preserved, and an unchanged value is returned as the same object.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if should_cast_to(value, dtype, device_filter) else value
    if value is None or isinstance(value, (str, bytes, int, float, bool, torch.dtype)):
        return value
    if isinstance(value, tuple):
        items = [cast_tree(item, dtype, device_filter) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, list):
        items = [cast_tree(item, dtype, device_filter) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return items if type(value) is list else _rebuild(value, items, list)
    if isinstance(value, collections.abc.Mapping):
        items = {key: cast_tree(item, dtype, device_filter) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return _rebuild_mapping(value, items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _rebuild_dataclass(value, dtype, device_filter)
    if isinstance(value, torch.nn.Module):
        # A module passed as an argument is not data; apex's `.to()` rule used to cast it.
        return value
    to = getattr(value, "to", None)
    if callable(to):
        return to(dtype)
    return value


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
