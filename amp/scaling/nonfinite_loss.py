"""A non-finite loss: the step is skipped as before, but the loss scale stays where it is.

apex halves the scale whenever the scaled gradients hold inf or NaN. When the loss itself is
inf or NaN no scale can help, and halving it step after step only ruins the scale for when the
loss is finite again (the "scale spiral": 65536 down to 6e-05 in 30 steps). So scale_loss also
keeps a device flag "the loss was finite", and the scale update ignores the overflow of a step
whose loss was not: the scale and the count of clean steps stay as they were. The flag is read
only on a step that is skipped anyway (its host sync is already paid).
"""

import types
import warnings

import torch

from .._state import amp_state
from . import origin as _origin  # noqa: F401  (sets amp_state.origin_watch)
from ..compat import distributed


class NonFiniteLossWarning(UserWarning):
    """The loss was inf or NaN: amp skipped the step and kept the loss scale (once per run)."""


def check(loss, needed):
    """A bool device tensor, True when `loss` is finite everywhere, or None when not `needed`
    (no dynamic scale update follows). No sync. An armed origin watch sees the loss too."""
    watch = amp_state.origin_watch
    if watch.armed:
        watch.note_loss(loss)
    if not needed:
        return None
    return torch.isfinite(loss).all()  # a bool result: no autograd graph, no detach needed


def agree(flag, loss_ok):
    """Make the overflow flag, and the loss flag if any, the same on every rank, in one
    collective: a rank whose loss was not finite makes every rank keep its scale. Returns the
    loss flag all ranks share (a no-op in one process)."""
    if not distributed.is_distributed():
        return loss_ok
    if loss_ok is None:
        distributed.reduce_flag(flag.tensor)
        return None
    both = torch.stack((flag.tensor, loss_ok.logical_not().to(flag.tensor.dtype)))
    distributed.reduce_flag(both)
    flag.tensor.copy_(both[0])
    return both[1] == 0


def update(scaler, flag, loss_ok):
    """`scaler.update(flag)`, except after a non-finite loss (`loss_ok` False on the device):
    then neither a back-off nor a clean step, so the scale and its count stay. No sync."""
    if loss_ok is None or not scaler.dynamic:
        scaler.update(flag)
        return
    if scaler._unskipped is None:
        scaler._tensors(flag.tensor.device)
    count = scaler._unskipped
    # The update counts a clean step (+1) when it sees no overflow; a bad loss is taken back
    # first (-1), so its count comes out unchanged and cannot reach a growth.
    count.add_(loss_ok if loss_ok.device == count.device else loss_ok.to(count.device)).sub_(1)
    scaler.update(types.SimpleNamespace(tensor=flag.tensor * loss_ok))


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
        stacklevel=6,
    )
