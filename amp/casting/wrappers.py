"""Wrapper factories for patched functions: amp's decision where its tables differ from torch's.

torch's autocast state is amp's (native_autocast.py). A wrapper calls its original at once where
torch's autocast is off in the calling thread. Where it is on, the wrapper looks at the device of
the call, and what lists/agreement.py decided for it there: TORCH (torch's autocast casts this op
as amp's table says) passes the call on; AMP casts the arguments as the table says and calls the
original; AMP_ALONE does the same with torch's autocast off for the call (torch would cast the
op, or ops it calls, another way). FP32 ops with a fixed signature get a wrapper written for it
(signatures.py) that returns at once when no argument is in low precision.

While an `amp.trace()` block is open anywhere, every table entry is wrapped (torch_patches.py),
and in the tracing thread amp casts every call itself (torch's autocast off inside) and records
it.

A wrapper is a plain closure rather than a `wrapt.FunctionWrapper`: on a `torch.Tensor` method it
costs a fraction of wrapt's bound proxy, and a plain function binds `self` as the first positional
argument, so one closure shape serves module functions and Tensor methods alike.
"""

import functools

import torch

from .._state import amp_state
from ..diagnostics.trace import traced_call
from ..lists import (
    BANNED,
    FP32,
    INPUT_DTYPE,
    LOWER_PRECISION,
    PROMOTE,
    SEQUENCE_PROMOTE,
    UNPATCHED,
)
from ..lists.agreement import AMP_ALONE, TORCH, aten_op, decision
from ..patching import ORIGINAL_ATTRIBUTE
from . import native_autocast as native_state
from .casts import CASTABLE, LOW_PRECISION, SEQUENCES, ExplicitDtype, policy_for

__all__ = [
    "cast_lower_precision",
    "cast_fp32",
    "cast_promote",
    "cast_sequence_promote",
    "refuse_low_precision",
    "CASTERS",
    "current_policy",
    "deciders_for",
    "compiled_call",
    "make_deciding",
    "make_tracing",
    "make_wrapper",
]


_Tensor = torch.Tensor
_dtype = torch.dtype
_float32 = torch.float32
_any_enabled = native_state.any_enabled
_is_enabled = native_state.is_enabled
_dtype_of = native_state.dtype_of
_cache_enabled = torch.is_autocast_cache_enabled
_without_autocast = native_state.without_autocast
# `torch.compiler.is_compiling()` is `False if torch.jit.is_scripting() else _is_compiling_flag`
# eagerly (two calls; a wrapper is never scripted) and a constant True under Dynamo, as is
# `is_dynamo_compiling()`; the flag covers torch.export's non-Dynamo tracing.
_compiler = torch.compiler
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling

_DEVICE_TYPES = ("cpu", "cuda")


def current_policy():
    """The CastPolicy of torch's autocast state in this thread (the one truth), or None."""
    if not _any_enabled():
        return None
    cpu = _dtype_of("cpu") if _is_enabled("cpu") else None
    cuda = _dtype_of("cuda") if _is_enabled("cuda") else None
    return policy_for(cpu, cuda, _cache_enabled())


def deciders_for(kind, op):
    """{device type: TORCH | AMP | AMP_ALONE} for a call of aten op `op` (None: a function torch
    cannot see as one op) that amp's table gives policy `kind`."""
    return {device: decision(kind, op, device) for device in _DEVICE_TYPES}


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


def _as_given(policy, args, kwargs):
    return None


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
    INPUT_DTYPE: _as_given,
}


def _caster(kind, name, message):
    return refuse_low_precision(name, message) if kind == BANNED else CASTERS[kind]


def _device_of(values):
    """The device type of the first tensor among `values` (looking into lists and tuples)."""
    for value in values:
        if isinstance(value, _Tensor):
            return value.device.type
        if value.__class__ in SEQUENCES:
            found = _device_of(value)
            if found is not None:
                return found
    return None


def _compiling():
    return _is_dynamo_compiling() or _compiler._is_compiling_flag


def _amp_call(original, caster, alone, policy, args, kwargs):
    """Run the call as amp's table says: its arguments cast, torch's autocast off if `alone`."""
    if kwargs and ("out" in kwargs or kwargs.get("dtype") is not None):
        new = None  # an out= call, or one naming its dtype, runs as asked
    else:
        new = caster(policy, args, kwargs)
    if new is not None:
        args, kwargs = new
    if alone:
        with _without_autocast():
            return original(*args, **kwargs)
    return original(*args, **kwargs)


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


def compiled_call(original, kind, name, message, args, kwargs, alone):
    """The call amp decides as torch.compile traces it: the same casts as eager, without amp's
    weight cache (the compiled graph makes each cast once) and without amp.trace records; torch's
    autocast off around the call where amp decides `alone` (Dynamo knows torch.autocast)."""
    policy = current_policy()
    device = _device_of((*args, *kwargs.values()))
    if policy is None or device is None or policy.dtype_for(device) is None:
        return original(*args, **kwargs)
    if not alone:
        return _compiled_cast_call(original, kind, name, message, policy, args, kwargs)
    with torch.autocast(device, enabled=False):
        return _compiled_cast_call(original, kind, name, message, policy, args, kwargs)


def _compiled_cast_call(original, kind, name, message, policy, args, kwargs):
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
    if kind == INPUT_DTYPE:
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


def _finish(wrapper, original, kind):
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, ORIGINAL_ATTRIBUTE, original)
    wrapper.__amp_kind__ = kind
    return wrapper


def _decider_of(deciders):
    on_cpu, on_cuda = deciders["cpu"], deciders["cuda"]

    def decider_for(args, kwargs):
        """The decider of a call, by the device of its first tensor (None: another device)."""
        device = _device_of(args) or (_device_of(kwargs.values()) if kwargs else None)
        if device == "cpu":
            return on_cpu, device
        if device == "cuda":
            return on_cuda, device
        return None, device

    return decider_for


def make_deciding(original, kind, name, message, deciders):
    """The decision of one call where torch's autocast is on: (args, kwargs) -> result. For the
    wrappers, and for the fixed-signature ones (signatures.py) on their rare path."""
    caster = _caster(kind, name, message)
    decider_for = _decider_of(deciders)

    def decide(args, kwargs):
        decider, device = decider_for(args, kwargs)
        if decider is None or decider is TORCH or not _is_enabled(device):
            return original(*args, **kwargs)  # under torch.compile too: Dynamo's autocast
        if _compiling():
            alone = decider is AMP_ALONE
            return compiled_call(original, kind, name, message, args, kwargs, alone)
        policy = current_policy()
        return _amp_call(original, caster, decider is AMP_ALONE, policy, args, kwargs)

    return decide


def make_tracing(original, kind, name, message, deciders):
    """A call in a thread with an open amp.trace(): amp casts it as its table says (torch's
    autocast off inside where amp decides alone) and records it. (args, kwargs) -> result."""
    caster = _caster(kind, name, message)
    decider_for = _decider_of(deciders)

    def trace(args, kwargs):
        if _compiling():  # nothing is recorded inside a compiled graph
            alone = decider_for(args, kwargs)[0] is AMP_ALONE
            return compiled_call(original, kind, name, message, args, kwargs, alone)
        policy = current_policy()
        if policy is None:
            return traced_call(original, name, kind, None, None, args, kwargs)
        if kwargs and ("out" in kwargs or kwargs.get("dtype") is not None):
            new = None
        else:
            new = caster(policy, args, kwargs)
        if decider_for(args, kwargs)[0] is AMP_ALONE:
            with _without_autocast():
                return traced_call(original, name, kind, policy, new, args, kwargs)
        # Where torch's autocast decides, it finds the arguments cast already.
        return traced_call(original, name, kind, policy, new, args, kwargs)

    return trace


def make_wrapper(original, kind, name, message=None, deciders=None):
    """A replacement for `original` that applies the casting policy `kind` where torch's
    autocast is on in the calling thread (amp's casting is in force), and calls `original`
    untouched elsewhere; in a thread with an open amp.trace() it records every call.

    `deciders` ({device type: TORCH | AMP | AMP_ALONE}) says who decides a call on each device;
    by default lists/agreement.py's answer for the aten op `original` is (AMP for a Python
    function). Calls pass through untouched for `out=` calls and when the call names its dtype
    (`dtype=` or positionally): an explicit dtype runs as asked.
    """
    if deciders is None:
        deciders = deciders_for(kind, aten_op(None, name, original))
    decide = make_deciding(original, kind, name, message, deciders)
    # A call the tables run as given is not recorded (it never was: amp patched none).
    trace = None if kind in UNPATCHED else make_tracing(original, kind, name, message, deciders)
    state = amp_state
    thread = amp_state.thread

    def amp_wrapper(*args, **kwargs):
        # `state.traces` (amp.trace blocks open in any thread, a plain attribute) before this
        # thread's own trace (a threading.local read, about three times the cost).
        if trace is not None and state.traces and thread.trace is not None:
            return trace(args, kwargs)
        if not _any_enabled():  # torch's autocast, which is amp's, is off in this thread
            return original(*args, **kwargs)
        return decide(args, kwargs)

    return _finish(amp_wrapper, original, kind)
