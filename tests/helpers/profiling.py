"""Load-independent figures of work (no timings in tests): Python calls counted by cProfile, and
the casts amp makes."""

import cProfile
import os
import pstats

import torch

import amp

AMP_DIR = os.path.dirname(amp.__file__)


def profile_calls(fn):
    """(calls in amp's own code, all calls, the names of the functions called) while `fn()` runs."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    stats = pstats.Stats(profile).stats
    own = sum(
        counts[1] for (filename, _, _), counts in stats.items() if filename.startswith(AMP_DIR)
    )
    names = {name for (_, _, name) in stats}
    # The profiler's own `disable` is counted once; leave it out.
    return own, pstats.Stats(profile).total_calls - 1, names


class CastCounter(torch.overrides.TorchFunctionMode):
    """Counts the casts amp makes: calls of Tensor.to and its dtype shorthands that change the
    dtype."""

    CASTS = (torch.Tensor.to, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.float)

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in self.CASTS and isinstance(result, torch.Tensor) and result is not args[0]:
            self.casts += 1
        return result
