"""Casting regions and scopes, one stack per thread: amp's policy and torch's autocast state
(native_autocast.py) change together and are put back in reverse order, as torch.autocast's are.

A region (amp.autocast, torch.autocast while amp's patches are installed, custom_fwd) changes the
dtype of one device or both and counts as torch's autocast nesting; a scope (disable_casts,
custom_bwd, a backward pass, an fp32_modules module) puts a whole policy in force. O1 sets the
state of the thread that calls initialize (`begin_thread_policy`).
"""

import contextlib
import warnings

import torch

from .._state import INHERIT, amp_state
from . import native_autocast as native_state
from .casts import KEEP, with_device

# False eagerly, True while Dynamo traces (torch's readers there are constants)
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling

__all__ = [
    "enter_scope",
    "exit_scope",
    "policy_scope",
    "enter_region",
    "exit_region",
    "begin_thread_policy",
]


def enter_scope(policy):
    """Put `policy` (None: no casting) in force in this thread, on every device, until
    `exit_scope(token)`: amp's policy and torch's autocast state."""
    patches = amp_state.torch_patches if policy is not None else None
    if patches is not None:
        patches.acquire()
    thread = amp_state.thread
    saved = thread.own_policy
    thread.own_policy = policy
    thread.depth += 1
    if policy is not None:
        amp_state.cast_cache.filled = True  # torch's cache fills without amp seeing it
    return saved, native_state.switch(native_state.targets_of(policy)), patches


def exit_scope(token):
    saved, native, patches = token
    thread = amp_state.thread
    try:
        native_state.restore(native)
        thread.own_policy = saved
        thread.depth -= 1
        if thread.unwound is not None and not thread.depth:
            _unwind(thread)
    finally:
        if patches is not None:
            patches.release()


def _unwind(thread):
    """The thread left its last region after O1 ended inside it: put torch's state back now."""
    unwound, thread.unwound = thread.unwound, None
    unwound()


@contextlib.contextmanager
def policy_scope(policy):
    """Run the block with `policy` (None: no casting) in force in this thread, every device."""
    token = enter_scope(policy)
    try:
        yield
    finally:
        exit_scope(token)


def enter_region(device_type, dtype, cache_enabled, float8=KEEP):
    """Open a casting region in this thread: on `device_type` (None: cpu and cuda) amp casts to
    `dtype` (None: not at all) until `exit_region(token)`, and runs F.linear in FP8 with recipe
    `float8` (None: not; KEEP: as the enclosing policy does). amp.autocast and torch.autocast
    (while amp's patches are installed) both come here, so the two nest as one stack of
    regions, which is torch's: its autocast state is set as torch.autocast sets it."""
    patches = amp_state.torch_patches
    if float8 is not KEEP and float8 is not None:
        patches.use_float8()  # F.linear's FP8 wrapper, from now until the patches are dropped
    patches.acquire()  # installs the patches on first use; they stay until amp.deinitialize()
    thread = amp_state.thread
    saved = thread.own_policy
    base = saved
    if saved is INHERIT:
        o1_thread = amp_state.o1_thread
        base = amp_state.default_policy if o1_thread is None or o1_thread == thread.ident else None
    key = (base, device_type, dtype, cache_enabled, float8)
    try:
        policy = _REGION_POLICIES[key]
    except KeyError:
        policy = _REGION_POLICIES[key] = with_device(*key)
    thread.own_policy = policy
    depth = thread.depth + 1  # kept: each read of a threading.local costs about 30 ns
    thread.depth = depth
    if (
        device_type is None
        and dtype is not None
        and not native_state.any_enabled()
        and not _is_dynamo_compiling()  # Dynamo traces torch's setters, not the dispatch keys
    ):
        native = native_state.enter_on(dtype, cache_enabled)  # a thread's first region
        dtype_changed = native[0] is not dtype or native[1] is not dtype
    else:
        native = native_state.switch(native_state.TARGETS[device_type, dtype], cache_enabled)
        native_state.increment_nesting()
        dtype_changed = native[2]
    cache = amp_state.cast_cache
    if dtype_changed and (depth > 1 or amp_state.o1_thread is not None):
        cache.clear()  # torch's cache holds casts to the dtype replaced here
    cache.filled = True  # torch's cache fills without amp seeing it
    return saved, native, dtype_changed


# (enclosing policy, device_type, dtype, cache_enabled, float8) -> the region's policy: policies
# are few and immutable (casts.policy_for), and a region should cost no more than torch's.
_REGION_POLICIES = {}


def exit_region(token):
    saved, native, dtype_changed = token
    thread = amp_state.thread
    try:
        if len(native) == 4:
            outermost = native_state.exit_on(native)
        else:
            outermost = native_state.decrement_nesting() == 0
            native_state.restore(native)
        thread.own_policy = saved
        depth = thread.depth - 1
        thread.depth = depth
    finally:
        amp_state.torch_patches.release()
    if outermost or dtype_changed:
        amp_state.cast_cache.clear()  # amp's and torch's, as torch.autocast's exit does
    if not depth and thread.unwound is not None:
        _unwind(thread)


def begin_thread_policy(policy):
    """O1: set torch's autocast state in this thread as `policy` (amp_state.default_policy) says,
    and make it this thread's only; return the function that ends it (in this thread, once it has
    left the regions open then: torch's state is per thread)."""
    if policy.cpu is None and policy.cuda is None:
        return _nothing  # float8 alone: torch's autocast stays off, every thread runs FP8
    thread = amp_state.thread  # a threading.local: read in the calling thread only
    native = native_state.switch(native_state.targets_of(policy), policy.cache_enabled)
    amp_state.cast_cache.filled = True  # torch's cache fills without amp seeing it
    ident = amp_state.o1_thread = thread.ident

    def restore():
        native_state.restore(native)

    def end():
        amp_state.o1_thread = None
        if thread.ident != ident:
            warnings.warn(
                "amp.deinitialize() ran in another thread than amp.initialize(): torch's "
                "autocast stays on in the thread that called initialize, which amp cannot reach "
                "from here. Call amp.deinitialize() in that thread.",
                RuntimeWarning,
                stacklevel=4,
            )
        elif thread.depth:
            thread.unwound = restore  # the regions open now put O1's state back as they exit
        else:
            restore()

    return end


def _nothing():
    return None
