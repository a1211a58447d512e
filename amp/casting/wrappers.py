"""Wrapper factories for patched functions: run in low precision, in FP32, in the widest type, or refuse.

A wrapper is a plain closure rather than a `wrapt.FunctionWrapper`: on a `torch.Tensor` method the
closure costs about 0.25 us per call against 0.7 us for wrapt's bound proxy (benchmarks/), and a
plain function binds `self` as the first positional argument, so one closure shape serves module
functions and Tensor methods alike.
"""

import functools

import torch

from .._state import INHERIT, amp_state
from ..diagnostics.trace import traced_call
from ..lists import BANNED, FP32, LOWER_PRECISION, PROMOTE, SEQUENCE_PROMOTE
from ..patching import ORIGINAL_ATTRIBUTE
from .casts import CASTABLE, LOW_PRECISION, PLAIN_ARGUMENTS, SEQUENCES, ExplicitDtype

__all__ = [
    "cast_lower_precision",
    "cast_fp32",
    "cast_promote",
    "cast_sequence_promote",
    "refuse_low_precision",
    "CASTERS",
    "compiled_call",
    "make_wrapper",
]


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_TENSOR_CLASSES = frozenset((_Tensor, _Parameter))  # what model code passes, tested first
_dtype = torch.dtype
_float32 = torch.float32
_data_ptr = torch._C.TensorBase.data_ptr
_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
# `torch.compiler.is_compiling()` is `False if torch.jit.is_scripting() else _is_compiling_flag`
# eagerly (two calls; a wrapper is never scripted) and a constant True under Dynamo, as is
# `is_dynamo_compiling()`; the flag covers torch.export's non-Dynamo tracing. Read in this order,
# the test costs one call eagerly, and Dynamo never reads (so never guards on) the flag.
_compiler = torch.compiler
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


def _cast_arguments(convert, args, kwargs):
    """(args, kwargs) with the tensors `convert` (a CastPolicy converter) casts, or None when
    nothing changes or the call names its dtype positionally."""
    try:
        new_args = convert(args)
        new_kwargs = None
        if kwargs:
            values = convert(kwargs.values())
            if values is not None:
                new_kwargs = dict(zip(kwargs, values))
    except ExplicitDtype:
        return None
    if new_args is None and new_kwargs is None:
        return None
    return (args if new_args is None else new_args), (kwargs if new_kwargs is None else new_kwargs)


def _floating_dtypes(values, policy, found):
    for value in values:
        if isinstance(value, _Tensor):
            if value.dtype in CASTABLE:
                if policy.device_filter is None or policy.device_filter(value):
                    found.add(value.dtype)
        elif value.__class__ in SEQUENCES:
            _floating_dtypes(value, policy, found)
    return found


def cast_lower_precision(policy, args, kwargs):
    return _cast_arguments(policy.to_low, args, kwargs)


def cast_fp32(policy, args, kwargs):
    return _cast_arguments(policy.to_fp32, args, kwargs)


def cast_promote(policy, args, kwargs):
    found = _floating_dtypes(args, policy, set())
    if kwargs:
        _floating_dtypes(kwargs.values(), policy, found)
    # Two different types among fp16/bf16/fp32 always widen to fp32 (torch.amp raises for an
    # fp16 + bf16 mix; amp promotes instead).
    if len(found) < 2:
        return None
    return _cast_arguments(policy.to_fp32, args, kwargs)


def cast_sequence_promote(policy, args, kwargs):
    if args and args[0].__class__ in SEQUENCES:
        sequence, rest = args[0], args[1:]
    elif kwargs and kwargs.get("tensors").__class__ in SEQUENCES:
        sequence, rest = kwargs["tensors"], args
    else:
        return None
    if len(_floating_dtypes(sequence, policy, set())) < 2:
        return None
    converted = policy.to_fp32(sequence)
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


# Where a policy's `fast` settings sit for each kind (casts.FastCast), for the inlined path of
# untraced calls.
_FAST_SLOTS = {LOWER_PRECISION: 0, FP32: 1}


def _traceable_cast(values, target_of):
    """`values` as a list with each tensor cast to `target_of(tensor)` (None: kept), looking
    inside lists and tuples. The torch.compile path: plain code Dynamo traces into the graph."""
    cast = []
    for value in values:
        if isinstance(value, _Tensor):
            target = target_of(value)
            cast.append(value if target is None else value.to(target))
        elif isinstance(value, SEQUENCES):
            cast.append(type(value)(_traceable_cast(value, target_of)))
        else:
            cast.append(value)
    return cast


def compiled_call(original, kind, name, message, policy, args, kwargs):
    """The patched call as torch.compile traces it: the same casts as eager, without the weight
    cache (the compiled graph makes each cast once) and without amp.trace records."""
    if kwargs.get("out") is not None or kwargs.get("dtype") is not None:
        return original(*args, **kwargs)
    if any(isinstance(value, _dtype) for value in args):
        return original(*args, **kwargs)
    values = list(args) + list(kwargs.values())
    found = _floating_dtypes(values, policy, set())
    if kind == BANNED:
        if found & LOW_PRECISION:
            raise NotImplementedError(message or f"amp refuses to run {name} in low precision.")
        return original(*args, **kwargs)
    if kind == LOWER_PRECISION:

        def target_of(tensor):
            target = policy.target_for(tensor)
            return target if tensor.dtype in CASTABLE and tensor.dtype != target else None

    else:
        if kind == SEQUENCE_PROMOTE:
            found = _floating_dtypes(args[:1] or values, policy, set())
        if kind in (PROMOTE, SEQUENCE_PROMOTE) and len(found) < 2:
            return original(*args, **kwargs)

        def target_of(tensor):
            low = tensor.dtype in LOW_PRECISION and policy.target_for(tensor) is not None
            return _float32 if low else None

    cast = _traceable_cast(values, target_of)
    return original(*cast[: len(args)], **dict(zip(kwargs, cast[len(args) :])))


def make_wrapper(original, kind, name, message=None):
    """A replacement for `original` that applies the casting policy `kind` when amp is casting.

    Calls pass through untouched when no policy is in force, for `out=` calls, and when the call
    names its dtype (`dtype=` or positionally): an explicit dtype runs as asked.
    """
    caster = refuse_low_precision(name, message) if kind == BANNED else CASTERS[kind]
    slot = _FAST_SLOTS.get(kind)
    thread = amp_state.thread
    state = amp_state

    def amp_wrapper(*args, **kwargs):
        if not state.active:  # nothing casts or traces anywhere: the original, at once
            return original(*args, **kwargs)
        policy = thread.policy
        if policy is INHERIT:
            policy = state.default_policy
        # `state.traces` (amp.trace blocks open in any thread, a plain attribute) before this
        # thread's own trace (a threading.local read, about three times the cost).
        if policy is None:
            if not state.traces or thread.trace is None:
                return original(*args, **kwargs)
            return traced_call(original, name, kind, None, None, args, kwargs)
        if slot is not None and not state.traces:
            fast = policy.fast[slot]
            if fast is not None:
                # The common call, the policy's converter and the weight-cast cache inlined (the
                # same rules as casts._converter and WeightCastCache.get_cast): it runs for every
                # patched op of a model, and each Python call here is host time per op. Dynamo
                # traces it as plain code; the compile test (see _compiler) runs only where the
                # cache would be used, which the compiled path goes without. Keyword arguments
                # are read with the positional ones (`x.sum(dim=-1)`, `is_causal=True`).
                if kwargs:
                    if "out" in kwargs:
                        return original(*args, **kwargs)  # an out= call runs as asked
                    values = (*args, *kwargs.values())
                else:
                    values = args
                cast, sources, on_cuda, cache, entries, convert = fast
                new_values = None
                compiling = None
                for index, value in enumerate(values):
                    # type(), not __class__: Dynamo answers `x.__class__ in a_set` wrongly for
                    # constants (and fails its own guard on it), `type(x) in a_set` rightly. The
                    # usual classes first, isinstance (a call) last: sizes and strides are tuples.
                    value_class = type(value)
                    if value_class in _TENSOR_CLASSES:
                        pass
                    elif value_class in PLAIN_ARGUMENTS:
                        continue
                    elif value_class in SEQUENCES:
                        for item in value:  # sizes and the like: nothing to cast, no call
                            if type(item) not in PLAIN_ARGUMENTS:
                                break
                        else:
                            continue
                        if _is_dynamo_compiling() or _compiler._is_compiling_flag:
                            return compiled_call(
                                original, kind, name, message, policy, args, kwargs
                            )
                        try:
                            inner = convert(value)
                        except ExplicitDtype:
                            return original(*args, **kwargs)
                        if inner is not None:
                            if new_values is None:
                                new_values = list(values)
                            new_values[index] = value_class(inner)
                        continue
                    elif value_class is _dtype:
                        return original(*args, **kwargs)  # the call names its dtype: as asked
                    elif not isinstance(value, _Tensor):
                        continue
                    dtype = value.dtype
                    if dtype not in sources:
                        continue
                    if on_cuda is not None and value.is_cuda is not on_cuda:
                        continue
                    if new_values is None:
                        new_values = list(values)
                    if (
                        entries is None
                        or dtype is not _float32
                        or not value.requires_grad
                        or not value.is_leaf
                    ):
                        new_values[index] = cast(value)
                        continue
                    if compiling is None:
                        compiling = _is_dynamo_compiling() or _compiler._is_compiling_flag
                    if compiling:
                        new_values[index] = cast(value)
                        continue
                    key = value._cdata  # no call, unlike id() and dict.get
                    if key in entries:
                        entry = entries[key]
                        if (
                            entry[1] == value._version
                            and entry[2] == _data_ptr(value)
                            and (entry[3].requires_grad or not _is_grad_enabled())
                        ):
                            new_values[index] = entry[3]
                            continue
                    result = new_values[index] = cast(value)
                    # A cast that requires grad was made in grad mode: kept for every later use.
                    # Reading that off the cast spares a grad-mode call per weight.
                    if result.requires_grad or not _is_inference_mode_enabled():
                        entries[key] = (value, value._version, _data_ptr(value), result)
                        cache.filled = True
                if new_values is None:
                    return original(*args, **kwargs)
                if not kwargs:
                    return original(*new_values)
                positional = len(args)
                new_kwargs = dict(zip(kwargs, new_values[positional:]))
                return original(*new_values[:positional], **new_kwargs)
        if _is_dynamo_compiling() or _compiler._is_compiling_flag:
            return compiled_call(original, kind, name, message, policy, args, kwargs)
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
