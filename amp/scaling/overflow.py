"""amp.last_overflow(): the report of the last skipped step, which loss and which parameters."""

import dataclasses
from typing import Tuple

from .._state import amp_state


@dataclasses.dataclass
class OverflowReport:
    """Where the gradients of a skipped step held inf or NaN."""

    loss_id: int  # the loss (scaler) whose backward produced the non-finite gradients
    params: Tuple[str, ...]  # qualified names of the parameters with non-finite gradients
    loss_scale: float  # the scale after backing off
    flag: object = dataclasses.field(default=None, repr=False, compare=False)


def last_overflow():
    """The OverflowReport of the last skipped step, or None if no step has been skipped."""
    return amp_state.last_overflow
