"""Casting regions: autocast, disable_casts, and custom_fwd / custom_bwd (thread-local state)."""

import contextlib
import functools

import torch

from ._state import amp_state
from .casts import DEVICE_TYPES, LOW_PRECISION, cast_tree, policy_for

_UNSET = object()


@contextlib.contextmanager
def policy_scope(policy):
    """Run the block with `policy` (None: no casting) in force in this thread.

    Installs the torch patches for the block when a policy is given, so the region casts even
    when nothing else holds them (a backward pass that runs after its autocast region exited).
    """
    thread = amp_state.thread
    saved = thread.__dict__.get("policy", _UNSET)
    patches = amp_state.torch_patches if policy is not None else None
    if patches is not None:
        patches.acquire()
    thread.policy = policy
    try:
        yield
    finally:
        if saved is _UNSET:
            del thread.policy  # back to the process-wide default
        else:
            thread.policy = saved
        if patches is not None:
            patches.release()


@contextlib.contextmanager
def disable_casts():
    """Context manager inside which amp casts nothing (nestable, thread-local, exception-safe).

    Example::

        with amp.disable_casts():
            loss = F.binary_cross_entropy(torch.sigmoid(logits.float()), target)
    """
    with policy_scope(None):
        yield


class autocast:
    """Context manager and decorator that applies amp's O1 casting policy in a region.

    Works without `amp.initialize`: the torch patches are installed on entry and removed when the
    last region in the process exits. Regions nest (an `autocast(enabled=False)` inside an enabled
    one turns casting off for its block), are thread-local, and restore their state on exceptions.
    Casts of FP32 weights are cached until the outermost region of the thread exits.

    Args:
        enabled (bool, optional, default=True): whether the region casts.
        dtype (torch.dtype, optional, default=torch.float16): the low-precision type,
            ``torch.float16`` or ``torch.bfloat16``.
        cache_enabled (bool, optional, default=True): reuse weight casts within the region.
        device_type (str, optional, default=None): ``"cpu"`` or ``"cuda"`` to cast only tensors
            on that device; None casts tensors on every device.

    Example::

        with amp.autocast(dtype=torch.bfloat16):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
    """

    def __init__(self, enabled=True, dtype=torch.float16, cache_enabled=True, device_type=None):
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast(enabled=...) must be a bool; got {enabled!r}.")
        if dtype not in LOW_PRECISION:
            raise ValueError(
                f"autocast(dtype={dtype!r}) is not a low-precision type; "
                "pass torch.float16 or torch.bfloat16."
            )
        if not isinstance(cache_enabled, bool):
            raise TypeError(f"autocast(cache_enabled=...) must be a bool; got {cache_enabled!r}.")
        if device_type is not None and device_type not in DEVICE_TYPES:
            raise ValueError(
                f"autocast(device_type={device_type!r}) is not supported; "
                f"pass one of {DEVICE_TYPES} or None for every device."
            )
        self.enabled = enabled
        self.dtype = dtype
        self.cache_enabled = cache_enabled
        self.device_type = device_type
        self._saved = []  # one entry per active entry of this object, for re-entrant use

    def __enter__(self):
        thread = amp_state.thread
        if self.enabled:
            amp_state.torch_patches.acquire()
            policy = policy_for(self.dtype, self.device_type, self.cache_enabled)
        else:
            policy = None
        self._saved.append(thread.__dict__.get("policy", _UNSET))
        thread.policy = policy
        thread.autocast_depth += 1
        return self

    def __exit__(self, *exc_info):
        thread = amp_state.thread
        saved = self._saved.pop()
        try:
            thread.autocast_depth -= 1
            if saved is _UNSET:
                del thread.policy
            else:
                thread.policy = saved
            if thread.autocast_depth == 0:
                amp_state.cast_cache.clear()
        finally:
            if self.enabled:
                amp_state.torch_patches.release()
        return False

    def __call__(self, func):
        if not callable(func):
            raise TypeError(
                f"autocast()(func) needs a callable, got {type(func).__name__}. "
                "Did you mean `with amp.autocast(...):`?"
            )
        settings = dict(
            enabled=self.enabled,
            dtype=self.dtype,
            cache_enabled=self.cache_enabled,
            device_type=self.device_type,
        )

        @functools.wraps(func)
        def decorate_autocast(*args, **kwargs):
            with autocast(**settings):
                return func(*args, **kwargs)

        return decorate_autocast


def custom_fwd(fwd=None, *, cast_inputs=None, device_type=None):
    """Decorator for the `forward` of a custom `torch.autograd.Function` (as torch.amp's).

    With `cast_inputs=None`, forward runs under whatever amp policy is in force and `custom_bwd`
    runs backward under the same one. With `cast_inputs=dtype`, inside a casting region the
    floating inputs (nested in containers too) are cast to `dtype` and forward (and backward) run
    with casting off; outside a region the decorator does nothing. `device_type`, accepted for
    torch.amp compatibility, limits the input casts to tensors on that device.
    """
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs, device_type=device_type)
    if cast_inputs is not None and (
        not isinstance(cast_inputs, torch.dtype) or not cast_inputs.is_floating_point
    ):
        raise ValueError(
            f"custom_fwd(cast_inputs=...) must be a floating dtype; got {cast_inputs!r}."
        )
    if device_type is not None and device_type not in DEVICE_TYPES:
        raise ValueError(f"custom_fwd(device_type={device_type!r}) must be one of {DEVICE_TYPES}.")
    device_filter = policy_for(torch.float16, device_type).device_filter

    @functools.wraps(fwd)
    def decorate_fwd(ctx, *args, **kwargs):
        policy = amp_state.thread.policy
        if cast_inputs is None or policy is None:
            ctx._amp_policy = policy
            return fwd(ctx, *args, **kwargs)
        ctx._amp_policy = None
        with policy_scope(None):
            return fwd(
                ctx,
                *cast_tree(args, cast_inputs, device_filter),
                **cast_tree(kwargs, cast_inputs, device_filter),
            )

    return decorate_fwd


def custom_bwd(bwd=None, *, device_type=None):
    """Decorator for the `backward` of a custom Function whose forward used `custom_fwd`.

    Backward runs under the casting policy its forward ran under (or none).
    """
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(ctx, *grad_outputs):
        with policy_scope(getattr(ctx, "_amp_policy", None)):
            return bwd(ctx, *grad_outputs)

    return decorate_bwd
