"""apex.optimizers.FusedSGD: torch.optim.SGD (apex's arithmetic is torch's, momentum buffer
`momentum_buffer` included), with apex's extra arguments."""

import torch
from torch.optim.optimizer import required

from .._ignored import warn_ignored
from ._common import GradNoneDefault


class FusedSGD(GradNoneDefault, torch.optim.SGD):
    """`set_grad_none` (default False, as apex) is honoured; `materialize_master_grads` has no
    effect (amp's O2 keeps its own master gradients); `wd_after_momentum=True`, which changes
    the arithmetic, is refused. `lr` may be left out when every parameter group sets its own, as
    with apex (torch.optim.SGD would fill in 1e-3; apex required it)."""

    def __init__(
        self,
        params,
        lr=required,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        wd_after_momentum=False,
        materialize_master_grads=True,
        set_grad_none=False,
    ):
        if wd_after_momentum:
            raise ValueError(
                "FusedSGD(wd_after_momentum=True) is not supported by amp's apex compatibility "
                "package: leave it False (weight decay added to the gradient before momentum, "
                "as torch.optim.SGD)."
            )
        if lr is required:
            params = list(params)
            _require_lr_in_every_group(params)
        super().__init__(
            params,
            lr=0.0 if lr is required else lr,  # never used: every group has its own
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        if lr is required:
            self.defaults["lr"] = required  # a group added later must carry its lr too
        self.set_grad_none = set_grad_none
        warn_ignored(
            "apex.optimizers.FusedSGD",
            "amp's O2 keeps its own master gradients",
            dict(materialize_master_grads=materialize_master_grads),
            dict(materialize_master_grads=True),
        )
        self.materialize_master_grads = materialize_master_grads


def _require_lr_in_every_group(params: list) -> None:
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    for index, group in enumerate(groups):
        if "lr" not in group:
            raise ValueError(
                f"FusedSGD: parameter group {index} didn't specify a value of required "
                "optimization parameter lr. Pass lr=... or give every parameter group its own "
                "'lr' (as apex's FusedSGD)."
            )
