"""amp.last_overflow(): the report of the last skipped step, which loss and which parameters;
GradScaler's skip report (amp.initialize's is weights/skip.py's)."""

import dataclasses
from typing import Optional, Tuple

from .. import distributed
from .._state import amp_state, logger

__all__ = ["OverflowReport", "last_overflow", "grad_scaler_nonfinite_names", "grad_scaler_update"]


@dataclasses.dataclass
class OverflowReport:
    """Where the gradients of a skipped step held inf or NaN."""

    loss_id: Optional[int]  # the loss (scaler) whose backward made them; None for GradScaler
    params: Tuple[str, ...]  # qualified names of the parameters with non-finite gradients
    loss_scale: float  # the scale after the update (backed off, or kept for a non-finite loss)
    flag: object = dataclasses.field(default=None, repr=False, compare=False)
    # Where the inf/NaN started (diagnostics.origin.Origin), known from the step after a skip on
    origin: Optional[object] = None
    nonfinite_loss: bool = False  # the loss itself was inf/NaN: the scale was kept, not halved


def last_overflow() -> OverflowReport | None:
    """The OverflowReport of the last skipped step, or None if no step has been skipped."""
    return amp_state.last_overflow


def grad_scaler_nonfinite_names(optimizer):
    """GradScaler: the parameters of `optimizer` whose gradients are not finite, by position
    ("param_groups[0]['params'][3]": GradScaler knows no names). Only on a skipped step."""
    names, params = {}, []
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            names[id(param)] = f"param_groups[{group_index}]['params'][{param_index}]"
            params.append(param)
    return distributed.nonfinite_names(params, lambda param: names[id(param)])


def grad_scaler_update(scaler, skipped):
    """GradScaler.update(): end a watched iteration; after a skip (`skipped`: the names from
    each optimizer that skipped; step() read the flags, so the host knows) report it and watch
    the next iteration."""
    watch = amp_state.origin_watch
    origin = watch.settle(scaler) if watch.armed else None
    if not skipped:
        return
    params = tuple(name for names in skipped for name in names)
    report = OverflowReport(None, params, scaler.get_scale(), origin=origin)
    amp_state.last_overflow = report
    message = f"Gradient overflow.  Skipping step, GradScaler reducing scale to {report.loss_scale}"
    if origin is not None:
        message += f"; it started in {origin}"
    if amp_state.verbosity >= 1:
        logger.info(message)
    watch.arm(scaler)
