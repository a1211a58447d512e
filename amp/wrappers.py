"""Wrapper factories for patched functions: run in low precision, in FP32, in the widest type, or refuse.

A wrapper is a plain closure rather than a `wrapt.FunctionWrapper`: on a `torch.Tensor` method the
closure costs about 0.25 us per call against 0.7 us for wrapt's bound proxy (benchmarks/), and a
plain function binds `self` as the first positional argument, so one closure shape serves module
functions and Tensor methods alike.
"""

import functools

import torch

from ._state import amp_state
from .casts import LOW_PRECISION
from .diagnostics import traced_call
from .patching import ORIGINAL_ATTRIBUTE

# The policy kinds, one per table in amp/lists.
LOWER_PRECISION = "lower_precision"  # FP16_FUNCS: run in the low-precision dtype
FP32 = "fp32"  # FP32_FUNCS: run in float32
PROMOTE = "promote"  # CASTS: run in the widest floating type among the arguments
SEQUENCE_PROMOTE = "sequence_promote"  # SEQUENCE_CASTS: the same over a sequence argument
BANNED = "banned"  # BANNED_FUNCS: refuse low-precision inputs, with advice

_Tensor = torch.Tensor
_dtype = torch.dtype
_float32 = torch.float32
_SEQUENCES = (list, tuple)


class _RunAsAsked(Exception):
    """Raised inside a caster when the call names its dtype positionally."""


def _convert_sequence(values, policy, target, sources):
    """A list with the eligible tensors of `values` cast to `target`, or None if none is."""
    converted = None
    device_filter = policy.device_filter
    cache = amp_state.cast_cache if target is policy.dtype and policy.cache_enabled else None
    index = -1
    for value in values:
        index += 1
        if isinstance(value, _Tensor):
            dtype = value.dtype
            if dtype in sources and (device_filter is None or device_filter(value)):
                if converted is None:
                    converted = list(values)
                # FP32 leaf tensors that require grad (weights) go through the cache.
                if (
                    cache is not None
                    and dtype is _float32
                    and value.requires_grad
                    and value.is_leaf
                ):
                    converted[index] = cache.get(value, target)
                else:
                    converted[index] = value.to(target)
        elif value.__class__ in _SEQUENCES:
            inner = _convert_sequence(value, policy, target, sources)
            if inner is not None:
                if converted is None:
                    converted = list(values)
                converted[index] = value.__class__(inner)
        elif value.__class__ is _dtype:
            raise _RunAsAsked
    return converted


def _cast_arguments(policy, target, sources, args, kwargs):
    """(args, kwargs) with eligible tensors cast, or None when nothing changes."""
    try:
        new_args = _convert_sequence(args, policy, target, sources)
        new_kwargs = None
        if kwargs:
            names = tuple(kwargs)
            values = _convert_sequence(tuple(kwargs.values()), policy, target, sources)
            if values is not None:
                new_kwargs = dict(zip(names, values))
    except _RunAsAsked:
        return None
    if new_args is None and new_kwargs is None:
        return None
    return (args if new_args is None else new_args), (kwargs if new_kwargs is None else new_kwargs)


def _floating_dtypes(values, policy, found):
    for value in values:
        if isinstance(value, _Tensor):
            if value.dtype in LOW_PRECISION or value.dtype is _float32:
                if policy.device_filter is None or policy.device_filter(value):
                    found.add(value.dtype)
        elif value.__class__ in _SEQUENCES:
            _floating_dtypes(value, policy, found)
    return found


def cast_lower_precision(policy, args, kwargs):
    return _cast_arguments(policy, policy.dtype, policy.to_low_sources, args, kwargs)


def cast_fp32(policy, args, kwargs):
    return _cast_arguments(policy, _float32, LOW_PRECISION, args, kwargs)


def cast_promote(policy, args, kwargs):
    found = _floating_dtypes(args, policy, set())
    if kwargs:
        _floating_dtypes(kwargs.values(), policy, found)
    # Two different types among fp16/bf16/fp32 always widen to fp32 (torch.amp raises for an
    # fp16 + bf16 mix; amp promotes instead).
    if len(found) < 2:
        return None
    return _cast_arguments(policy, _float32, LOW_PRECISION, args, kwargs)


def cast_sequence_promote(policy, args, kwargs):
    if args and args[0].__class__ in _SEQUENCES:
        sequence, rest = args[0], args[1:]
    elif kwargs and kwargs.get("tensors").__class__ in _SEQUENCES:
        sequence, rest = kwargs["tensors"], args
    else:
        return None
    if len(_floating_dtypes(sequence, policy, set())) < 2:
        return None
    converted = _convert_sequence(sequence, policy, _float32, LOW_PRECISION)
    new_sequence = sequence.__class__(converted)
    if rest is args:
        return args, dict(kwargs, tensors=new_sequence)
    return (new_sequence,) + tuple(rest), kwargs


def refuse_low_precision(name, message):
    def caster(policy, args, kwargs):
        found = _floating_dtypes(args, policy, set())
        if kwargs:
            _floating_dtypes(kwargs.values(), policy, found)
        if found & LOW_PRECISION:
            raise NotImplementedError(message or f"amp refuses to run {name} in low precision.")
        return None

    return caster


CASTERS = {
    LOWER_PRECISION: cast_lower_precision,
    FP32: cast_fp32,
    PROMOTE: cast_promote,
    SEQUENCE_PROMOTE: cast_sequence_promote,
}


def make_wrapper(original, kind, name, message=None):
    """A replacement for `original` that applies the casting policy `kind` when amp is casting.

    Calls pass through untouched when no policy is in force, for `out=` calls, and when the call
    names its dtype (`dtype=` or positionally): an explicit dtype runs as asked.
    """
    caster = refuse_low_precision(name, message) if kind == BANNED else CASTERS[kind]
    thread = amp_state.thread

    def amp_wrapper(*args, **kwargs):
        policy = thread.policy
        if policy is None:
            if thread.trace is None:
                return original(*args, **kwargs)
            return traced_call(original, name, kind, None, None, args, kwargs)
        if kwargs and ("out" in kwargs or kwargs.get("dtype") is not None):
            new = None
        else:
            new = caster(policy, args, kwargs)
        if thread.trace is not None:
            return traced_call(original, name, kind, policy, new, args, kwargs)
        if new is None:
            return original(*args, **kwargs)
        return original(*new[0], **new[1])

    functools.update_wrapper(amp_wrapper, original)
    setattr(amp_wrapper, ORIGINAL_ATTRIBUTE, original)
    amp_wrapper.__amp_kind__ = kind
    return amp_wrapper
