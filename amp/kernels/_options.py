"""The hyperparameters of one fused step, one object per parameter group and step: made by the
caller from the group, read as they are by every backend and every form of the state."""

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["AdamOptions", "SGDOptions"]


class AdamOptions(NamedTuple):
    """torch.optim.AdamW's (`decoupled`) or Adam's hyperparameters, as floats."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    def fused_op(self) -> Callable[..., None]:
        """torch's fused op for these options (AdamW's or Adam's)."""
        return torch._fused_adamw_ if self.decoupled else torch._fused_adam_

    def fused_kwargs(self, found_inf: torch.Tensor | None) -> dict[str, Any]:
        """The keyword arguments of torch's fused op for these options."""
        return dict(
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            weight_decay=self.weight_decay,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
            found_inf=found_inf,
        )


class SGDOptions(NamedTuple):
    """torch.optim.SGD's hyperparameters, as floats."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool

    def fused_kwargs(self, found_inf: torch.Tensor | None, first_step: bool) -> dict[str, Any]:
        """The keyword arguments of torch's `_fused_sgd_` for these options (`first_step`: the
        momentum buffers start as the gradients)."""
        return dict(
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr=self.lr,
            dampening=self.dampening,
            nesterov=self.nesterov,
            maximize=False,
            is_first_step=first_step,
            found_inf=found_inf,
        )
