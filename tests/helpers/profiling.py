"""Python calls counted by cProfile: a load-independent figure of host work (no timings in tests)."""

import cProfile
import os
import pstats

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
