"""torch.autocast regions as amp regions, and backward without autocast, while amp's patches are
installed.

torch's autocast state is amp's (native_autocast.py), so torch's readers
(`torch.is_autocast_enabled`, `torch.get_autocast_dtype`, ...) report amp's casting as they are,
and `torch.utils.checkpoint`, `torch.amp.custom_fwd` and `RNNBase.check_input` see it. Two things
are patched:

- `torch.autocast.__enter__` / `__exit__`: a torch.autocast region on cpu/cuda opens an amp
  region (amp.autocast's), which sets torch's state as torch's own region would and also keeps
  amp's policy, its weight-cast cache and float8 in step. So `torch.autocast(enabled=False)` is
  an FP32 island and a nested `torch.autocast(dtype=X)` a region in X, as amp's tables decide.
- `torch.autograd`'s engine entry: a backward pass (backward(), autograd.grad) runs with casting
  off, as it does after a torch.autocast region (O1 casts for the whole run, backward included):
  the backward of an FP32 island stays FP32. `custom_bwd` and checkpoint's recomputation open
  their own regions.
"""

import functools
import sys

import torch

from ..patching import ORIGINAL_ATTRIBUTE
from . import native_autocast as native_state
from .casts import DEVICE_TYPES
from .regions import enter_region, exit_region

__all__ = ["patches"]

_is_compiling = torch.compiler.is_compiling
_GRAPH_ENTER = torch.amp.autocast_mode._enter_autocast.__code__  # FX graphs' autocast entry


def _mark(replacement, original):
    setattr(replacement, ORIGINAL_ATTRIBUTE, original)
    return replacement


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


def _backward(original):
    @functools.wraps(original)
    def run_backward(*args, **kwargs):
        if not native_state.any_enabled():
            return original(*args, **kwargs)
        # torch's autocast excluded, which the engine carries into its threads; amp's policy as
        # it is, so checkpoint's recomputation (a torch.autocast region, which sets the
        # forward's state again) keeps its float8 recipe.
        with native_state.without_autocast():
            return original(*args, **kwargs)

    return _mark(run_backward, original)


def patches():
    """(namespace, name, make_replacement) for torch.autocast's enter and exit and the engine
    entry of backward passes."""
    autocast_class = torch.amp.autocast_mode.autocast
    return [
        (autocast_class, "__enter__", _enter),
        (autocast_class, "__exit__", _exit),
        (torch.autograd, "_engine_run_backward", _backward),
    ]
