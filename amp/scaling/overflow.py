"""amp.last_overflow(): the report of the last skipped step, which loss and which parameters."""

import dataclasses
from typing import Optional, Tuple

from .._state import amp_state


@dataclasses.dataclass
class OverflowReport:
    """Where the gradients of a skipped step held inf or NaN."""

    loss_id: Optional[int]  # the loss (scaler) whose backward made them; None for GradScaler
    params: Tuple[str, ...]  # qualified names of the parameters with non-finite gradients
    loss_scale: float  # the scale after the update (backed off, or kept for a non-finite loss)
    flag: object = dataclasses.field(default=None, repr=False, compare=False)
    # Where the inf/NaN started (scaling.origin.Origin), known from the step after a skip on
    origin: Optional[object] = None
    nonfinite_loss: bool = False  # the loss itself was inf/NaN: the scale was kept, not halved


def last_overflow():
    """The OverflowReport of the last skipped step, or None if no step has been skipped."""
    return amp_state.last_overflow
