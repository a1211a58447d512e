"""Load-independent figures of work (no timings in tests): Python calls counted by cProfile, and
the casts amp makes."""

import cProfile
import os
import pstats

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class CastCounter(TorchDispatchMode):
    """Counts the dtype casts made while it is active, by amp (its wrappers cast in Python) or by
    torch's autocast (in C++): both reach aten._to_copy below the autocast dispatch keys."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and result.dtype != args[0].dtype:
            self.casts += 1
        return result
