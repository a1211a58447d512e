"""apex.optimizers.FusedSGD: torch.optim.SGD (apex's arithmetic is torch's, momentum buffer
`momentum_buffer` included), with apex's extra arguments."""

import torch

from ._common import GradNoneDefault


class FusedSGD(GradNoneDefault, torch.optim.SGD):
    """`set_grad_none` (default False, as apex) is honoured; `materialize_master_grads` has no
    effect (amp's O2 keeps its own master gradients); `wd_after_momentum=True`, which changes
    the arithmetic, is refused."""

    def __init__(
        self,
        params,
        lr,
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
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        self.set_grad_none = set_grad_none
        self.materialize_master_grads = materialize_master_grads
