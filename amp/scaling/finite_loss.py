"""A non-finite loss: the step is skipped as before, but the loss scale stays where it is.

apex halves the scale whenever the scaled gradients hold inf or NaN. When the loss itself is
inf or NaN no scale can help, and halving it step after step only ruins the scale for when the
loss is finite again (the "scale spiral": 65536 down to 6e-05 in 30 steps). So each unscaling
block also leaves on the device whether its loss was finite (`loss * 0` is NaN exactly when the
loss is not finite: two ops), and the scale update ignores the overflow of a block whose loss was
not: the scale and the count of clean steps stay as they were (scaler.py). The host learns it with
the block's other results (weights/checks.py); the warning is diagnostics/nonfinite_loss.py's.
"""

import torch

from .. import distributed
from ..weights.checks import BAD, FOUND

__all__ = ["check", "agree"]


def check(loss, check):
    """Leave in `check` (weights/checks.Check) whether `loss` is not finite. No sync."""
    zero = loss.detach() * 0
    if zero.dim() or zero.device != check.bad.device:  # a loss of shape (1,), another device
        zero = zero.sum().to(check.bad.device)
    torch.ne(zero, 0, out=check.bad)


def agree(check):
    """Make the block's flags (gradients, loss) the MAX over all ranks, in one collective: every
    rank takes the same skip decision and keeps the same scale. A no-op in one process."""
    if distributed.is_distributed():
        # Both words are 0 or positive (the bits of 0.0 / 1.0, and 0 / 1): MAX over the int32
        # words is MAX over their values.
        distributed.reduce_flag(check.state[FOUND : BAD + 1])
