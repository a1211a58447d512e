"""A non-finite loss: the step is skipped as before, but the loss scale stays where it is.

apex halves the scale whenever the scaled gradients hold inf or NaN. When the loss itself is
inf or NaN no scale can help, and halving it step after step only ruins the scale for when the
loss is finite again (the "scale spiral": 65536 down to 6e-05 in 30 steps). So scale_loss also
keeps a device flag "the loss was finite", and the scale update ignores the overflow of a step
whose loss was not: the scale and the count of clean steps stay as they were. The flag is read
only on a step that is skipped anyway (its host sync is already paid); the warning is
diagnostics/nonfinite_loss.py's.
"""

import types

import torch

from .. import distributed
from .._state import amp_state


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
