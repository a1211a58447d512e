"""The hyperparameters of one fused step, one object per parameter group and step: made by the
caller from the group, read as they are by every backend and every form of the state."""

from typing import NamedTuple

__all__ = ["AdamOptions", "SGDOptions"]


class AdamOptions(NamedTuple):
    """torch.optim.AdamW's (`decoupled`) or Adam's hyperparameters, as floats."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


class SGDOptions(NamedTuple):
    """torch.optim.SGD's hyperparameters, as floats."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
