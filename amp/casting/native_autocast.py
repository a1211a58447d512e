"""torch's own autocast state (its thread-local C++ flags), which amp's casting sets: one truth.

Where amp casts (an O1 thread, an amp.autocast or torch.autocast region), torch's autocast is on
with amp's dtypes, so torch's C++ autocast casts the ops on which amp's tables agree with it, and
torch's readers (`torch.is_autocast_enabled`, ...) report amp's state as their own. Each change
saves what it replaces and puts it back, as torch.autocast does, so amp's and torch's regions nest
as one stack.
"""

import torch

from .casts import DEVICE_TYPES

__all__ = [
    "any_enabled",
    "is_enabled",
    "dtype_of",
    "switch",
    "enter_on",
    "exit_on",
    "TARGETS",
    "targets_of",
    "restore",
    "increment_nesting",
    "decrement_nesting",
    "policy_written",
    "without_autocast",
]

any_enabled = torch._C._is_any_autocast_enabled
is_enabled = torch.is_autocast_enabled
dtype_of = torch.get_autocast_dtype
_set_enabled = torch.set_autocast_enabled
_set_dtype = torch.set_autocast_dtype
_cache_enabled = torch.is_autocast_cache_enabled
_set_cache_enabled = torch.set_autocast_cache_enabled
# torch's autocast is on for a device where the device's autocast dispatch key is not excluded
# in this thread (what at::autocast::set_autocast_enabled sets): set through the key, without
# parsing a device string, a region's second device costs less (tests/casting/
# test_native_autocast.py reads the result back through torch's readers).
_exclude = torch._C._dispatch_tls_set_dispatch_key_excluded
_AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU
_AUTOCAST_CUDA = torch._C.DispatchKey.AutocastCUDA
# Excludes every autocast dispatch key for a block: a call amp decides runs inside it, so that
# torch's autocast casts nothing on top (the ops it calls included).
without_autocast = torch._C._DisableAutocast


# What `switch` replaced: (((device, enabled before, dtype before or None), ...) for the devices
# it changed, the cache flag before (None: unchanged), whether a device's dtype changed (torch's
# cache, keyed by the weight alone, may then hold casts to the other dtype)).
_NOTHING = ((), None, False)


def switch(targets, cache_enabled=None):
    """Set torch's autocast, for each (device type, dtype) of `targets`, to cast to that dtype
    there (None: not at all), and its cache flag to `cache_enabled` (None: as it is); return what
    it replaced, for `restore`."""
    changed = []
    dtype_changed = False
    anything_on = any_enabled()
    for device, dtype in targets:
        enabled = anything_on and is_enabled(device)
        if dtype is None:
            if enabled:
                changed.append((device, True, None))
                _set_enabled(device, False)
            continue
        before = dtype_of(device)
        if before is not dtype:
            _set_dtype(device, dtype)
            dtype_changed = True
        if not enabled:
            _set_enabled(device, True)
        if before is not dtype or not enabled:
            changed.append((device, enabled, None if before is dtype else before))
    cache_before = None
    if cache_enabled is not None and _cache_enabled() is not cache_enabled:
        cache_before = not cache_enabled
        _set_cache_enabled(cache_enabled)
    if not changed and cache_before is None:
        return _NOTHING
    return changed, cache_before, dtype_changed


def enter_on(dtype, cache_enabled):
    """A region's entry where cpu and cuda are both off (a thread's first region): both to
    `dtype`, the cache flag, one more nesting level; unrolled, in one call, since a region should
    cost what torch's costs and this one sets two devices. Its result is for `exit_on`: (cpu's
    dtype before, cuda's, the cache flag before or None, `dtype`)."""
    cpu = dtype_of("cpu")
    cuda = dtype_of("cuda")
    if cpu is not dtype:
        _set_dtype("cpu", dtype)
    if cuda is not dtype:
        _set_dtype("cuda", dtype)
    _exclude(_AUTOCAST_CPU, False)
    _exclude(_AUTOCAST_CUDA, False)
    cache_before = None
    if _cache_enabled() is not cache_enabled:
        cache_before = not cache_enabled
        _set_cache_enabled(cache_enabled)
    increment_nesting()
    return cpu, cuda, cache_before, dtype


def exit_on(saved):
    """Undo `enter_on`; return whether the region was the outermost (torch.autocast's exit
    empties torch's weight-cast cache then: the caller does, with amp's)."""
    outermost = decrement_nesting() == 0
    cpu, cuda, cache_before, dtype = saved
    if cpu is not dtype:
        _set_dtype("cpu", cpu)
    if cuda is not dtype:
        _set_dtype("cuda", cuda)
    _exclude(_AUTOCAST_CPU, True)
    _exclude(_AUTOCAST_CUDA, True)
    if cache_before is not None:
        _set_cache_enabled(cache_before)
    return outermost


# (device type, dtype) -> the `switch` targets that cast to `dtype` on `device_type` (None: cpu
# and cuda; dtype None: off).
TARGETS = {
    (device_type, dtype): (
        (("cpu", dtype), ("cuda", dtype)) if device_type is None else ((device_type, dtype),)
    )
    for device_type in (None, *DEVICE_TYPES)
    for dtype in (None, torch.float16, torch.bfloat16)
}


def targets_of(policy):
    """The `switch` targets of a CastPolicy (None: casting off everywhere)."""
    if policy is None:
        return _OFF
    return (("cpu", policy.cpu), ("cuda", policy.cuda))


_OFF = (("cpu", None), ("cuda", None))


def restore(saved):
    """Put back what `switch` replaced."""
    changed, cache_before, _ = saved
    for device, enabled, dtype in changed:
        if dtype is not None:
            _set_dtype(device, dtype)
        _set_enabled(device, enabled)
    if cache_before is not None:
        _set_cache_enabled(cache_before)


# A region's nesting, as torch.autocast counts it: when the outermost exits, torch's
# weight-cast cache is emptied (the caller does it, with amp's: WeightCastCache.clear).
increment_nesting = torch.autocast_increment_nesting
decrement_nesting = torch.autocast_decrement_nesting


def policy_written(thread, old, new):
    """torch's state follows a write of `thread.policy` made outside amp's regions (the optimizer
    step amp drives turns casting off with it, then puts the policy back): a write of None
    excludes torch's autocast, the write that ends it lifts the exclusion."""
    if new is None and old is not None:
        guard = without_autocast()
        guard.__enter__()
        thread.saved_native.append(guard)
    elif old is None and new is not None and thread.saved_native:
        thread.saved_native.pop().__exit__(None, None, None)
