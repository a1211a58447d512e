"""amp.NonFiniteLossWarning: a step skipped because the loss itself was inf or NaN, said once per
run of such steps, with where the inf/NaN started (the origin watch of the step after).

The scale stays where it was on such a step (scaling/device_scale.py says why).
"""

import os
import sys
import warnings

from .._state import amp_state

_AMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

__all__ = ["NonFiniteLossWarning", "after_clean_step", "after_bad_loss"]


class NonFiniteLossWarning(UserWarning):
    """The loss was inf or NaN: amp skipped the step and kept the loss scale (once per run)."""


def after_clean_step():
    """A step with overflow checks and no skip for a bad loss: a run of bad losses ends."""
    if amp_state.nonfinite_loss_run == "pending":
        _warn(None, None, watched_clean=True)
    amp_state.nonfinite_loss_run = None


def after_bad_loss(loss_id, origin, watched):
    """A step skipped because loss `loss_id` was not finite; warn once per run of them.

    The warning waits for the step after the first one, which amp watches, so it can say where
    the inf/NaN started; `watched` tells whether this step was that watched one.
    """
    run = amp_state.nonfinite_loss_run
    if run == "warned":
        return
    if origin is None and not watched and run is None:
        amp_state.nonfinite_loss_run = "pending"
        return
    _warn(loss_id, origin, watched_clean=False)
    amp_state.nonfinite_loss_run = "warned"


def _warn(loss_id, origin, watched_clean):
    if watched_clean:
        where = (
            "The step after it had a finite loss, so amp could not watch where it started; if it "
            "comes back, amp names the place"
        )
        subject = "A loss was inf or NaN at one step"
    else:
        where = f"It started in {origin}" if origin else "amp did not find where it started"
        subject = f"The loss (loss_id={loss_id}) is inf or NaN"
    warnings.warn(
        f"{subject}: amp skipped the step and kept the loss scale (no scale makes a non-finite "
        f"loss finite). {where}. Keep the module that overflows in FP32 "
        "(amp.initialize(..., fp32_modules=[...])), or find it with amp.audit(...); "
        "amp.last_overflow().origin has the details. This warning comes once per run of such "
        "steps.",
        NonFiniteLossWarning,
        stacklevel=_outside_amp(),
    )


def _outside_amp():
    """The stacklevel of the first caller outside amp: the user's step(), zero_grad() or
    scale_loss, whichever learned of the skip."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_AMP_DIR):
        frame, level = frame.f_back, level + 1
    return level
