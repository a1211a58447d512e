"""PyTorch's autocast surface, answered from amp's state: one truth in both directions.

While amp's patches are installed, the Python functions through which PyTorch and libraries ask
about autocast (`torch.is_autocast_enabled`, `torch.get_autocast_dtype`, ...) report amp's casting
state in the calling thread, and `torch.autocast` regions on cpu/cuda are amp regions. So
`torch.utils.checkpoint` recomputes under the state the forward saw, `torch.amp.custom_fwd` turns
amp's casting off for its body, `RNNBase.check_input` accepts low-precision inputs, and
`torch.autocast(enabled=False)` islands run in FP32, all decided by amp's tables. torch's own
(dispatcher-level) autocast stays off, so backward is never autocast and an op runs once, as amp
decides. In a thread where amp has said nothing (no region, no O1), the originals answer.
"""

import functools
import sys

import torch

from .._state import INHERIT, amp_state
from . import native_autocast as native_state
from .autocast import enter_region, exit_region
from .casts import DEVICE_TYPES
from ..patching import ORIGINAL_ATTRIBUTE

__all__ = ["first_policy", "patches"]

_thread = amp_state.thread
_is_compiling = torch.compiler.is_compiling
_GRAPH_ENTER = torch.amp.autocast_mode._enter_autocast.__code__  # FX graphs' autocast entry


class _TorchRegion:
    """The policy of a thread that amp first sees inside a torch.autocast region of torch's own
    (opened before amp's patches were installed, so torch's dispatcher casts there).

    While torch's autocast is on in the thread amp casts nothing and torch's readers answer, so
    an op is cast once, as torch alone would. Once it is off the thread inherits amp's policy
    again (O1's): the region's `__exit__` was bound before amp patched it, so amp notices at the
    thread's next patched call. Duck-types CastPolicy for the wrappers and regions.
    """

    __slots__ = ()

    def current(self):
        """None while torch's region is on; else the policy the thread inherits from now on."""
        if native_state.any_enabled():
            return None
        if _thread.policy is self:
            _thread.policy = INHERIT
        return amp_state.default_policy

    def _ask(self, name, default, *args):
        policy = self.current()
        if policy is None:
            return default
        value = getattr(policy, name)
        return value(*args) if args else value

    cpu = property(lambda self: self._ask("cpu", None))
    cuda = property(lambda self: self._ask("cuda", None))
    cache_enabled = property(lambda self: self._ask("cache_enabled", True))
    float8 = property(lambda self: self._ask("float8", None))
    device_filter = property(lambda self: self._ask("device_filter", _nothing))

    fast = (None, None)  # the wrappers call to_low / to_fp32 below: they answer as of now

    def to_low(self, values):
        return self._ask("to_low", None, values)

    def to_fp32(self, values):
        return self._ask("to_fp32", None, values)

    def dtype_for(self, device_type):
        return self._ask("dtype_for", None, device_type)

    def target_for(self, tensor):
        return self._ask("target_for", None, tensor)


def _nothing(tensor):
    return False


_TORCH_REGION = _TorchRegion()


def first_policy():
    """A thread's policy when amp first sees it (AmpState.first_policy)."""
    return _TORCH_REGION if native_state.any_enabled() else INHERIT


def _amp_policy():
    """(amp decides in this thread, its policy): a region set the policy here, or O1 did for
    every thread. While torch.compile compiles, torch's own state answers: Dynamo saves and
    restores the global autocast state around tracing with torch's setters."""
    if _is_compiling():
        return False, None
    policy = _thread.policy
    if policy is INHERIT:
        policy = amp_state.default_policy
        return policy is not None, policy
    if policy is _TORCH_REGION:
        policy = policy.current()
        return policy is not None, policy
    return True, policy


def _reader(original, answer):
    """A replacement for torch reader `original`: `answer(policy, *args, **kwargs)` where amp
    decides (NotImplemented falls back to the original), the original elsewhere."""

    @functools.wraps(original)
    def read(*args, **kwargs):
        decides, policy = _amp_policy()
        if decides:
            try:
                result = answer(policy, *args, **kwargs)
            except TypeError:  # a call torch refuses: torch's own error
                result = NotImplemented
            if result is not NotImplemented:
                return result
        return original(*args, **kwargs)

    return _mark(read, original)


def _mark(replacement, original):
    setattr(replacement, ORIGINAL_ATTRIBUTE, original)
    return replacement


def _amp_dtype(policy, device_type):
    """amp's dtype on `device_type` ("cpu:0" counts as "cpu"), or None: where amp casts nothing
    torch's own state answers (off, unless a torch.autocast region opened before amp was used)."""
    if policy is None or not isinstance(device_type, str):
        return None
    return policy.dtype_for(device_type.partition(":")[0])


def _enabled(policy, device_type="cuda"):
    # torch.is_autocast_enabled() without a device asks about CUDA (its deprecated form).
    return NotImplemented if _amp_dtype(policy, device_type) is None else True


def _dtype(policy, device_type):
    dtype = _amp_dtype(policy, device_type)
    return NotImplemented if dtype is None else dtype


def _cache_enabled(policy):
    return NotImplemented if policy is None else policy.cache_enabled


def _any_enabled(policy):
    if policy is None or (policy.cpu is None and policy.cuda is None):  # none, or float8 alone
        return NotImplemented
    return True


def _cpu_enabled(policy):
    return _enabled(policy, "cpu")


def _cpu_dtype(policy):
    return _dtype(policy, "cpu")


def _gpu_dtype(policy):
    return _dtype(policy, "cuda")


def _enter(original):
    @functools.wraps(original)
    def __enter__(self):
        # torch's own region: on other devices, while compiling, and where a compiled or
        # exported graph enters it at run time (its ops are not amp's wrappers, so only torch's
        # dispatcher can cast them).
        if (
            self.device not in DEVICE_TYPES
            or _is_compiling()
            or sys._getframe(1).f_code is _GRAPH_ENTER
        ):
            return original(self)
        dtype = self.fast_dtype if self._enabled else None
        token = enter_region(self.device, dtype, self._cache_enabled)
        self.__dict__.setdefault("_amp_regions", []).append(token)
        return self

    return _mark(__enter__, original)


def _exit(original):
    @functools.wraps(original)
    def __exit__(self, exc_type, exc_value, traceback):
        regions = self.__dict__.get("_amp_regions")
        if not regions:  # entered before amp's patches were installed: torch's own region
            return original(self, exc_type, exc_value, traceback)
        exit_region(regions.pop())
        return False

    return _mark(__exit__, original)


_READERS = {
    "is_autocast_enabled": _enabled,
    "get_autocast_dtype": _dtype,
    "is_autocast_cache_enabled": _cache_enabled,
    "is_autocast_cpu_enabled": _cpu_enabled,
    "get_autocast_cpu_dtype": _cpu_dtype,
    "get_autocast_gpu_dtype": _gpu_dtype,
}


def patches():
    """(namespace, name, make_replacement) for every attribute of torch's autocast surface."""
    found = [
        (torch, name, functools.partial(_reader, answer=answer))
        for name, answer in _READERS.items()
        if hasattr(torch, name)
    ]
    found.append(
        (torch._C, "_is_any_autocast_enabled", functools.partial(_reader, answer=_any_enabled))
    )
    autocast_class = torch.amp.autocast_mode.autocast
    found.append((autocast_class, "__enter__", _enter))
    found.append((autocast_class, "__exit__", _exit))
    return found
