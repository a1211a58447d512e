"""apex.optimizers.FusedAdam: apex's Adam arithmetic with torch._foreach_* (in float32 for
float16/bfloat16 parameters, as apex's kernels), apex's defaults (decoupled weight decay:
adam_w_mode=True) and apex's state layout (`exp_avg`, `exp_avg_sq`, `group['step']`), so apex
checkpoints load."""

import torch

from .._ignored import warn_ignored
from ._common import (
    GradNoneDefault,
    adam_moments,
    float32_lists,
    next_step,
    refuse_old_step_arguments,
)


class FusedAdam(GradNoneDefault, torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as apex).")
        if master_weights:
            raise ValueError(
                "FusedAdam(master_weights=True) is not supported: use amp.initialize(model, "
                "optimizer, opt_level='O2'), which keeps FP32 master weights for the optimizer."
            )
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none
        warn_ignored(
            "apex.optimizers.FusedAdam",
            "it let apex's kernel be captured in a CUDA graph; the step here is torch's foreach "
            "arithmetic, with the same results",
            dict(capturable=capturable),
            dict(capturable=False),
        )
        self.capturable = capturable

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None):
        refuse_old_step_arguments(
            "FusedAdam",
            grads=grads,
            output_params=output_params,
            scale=scale,
            grad_norms=grad_norms,
        )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group is checked (dtypes, sparse gradients) before any is stepped.
        lists = [float32_lists(self, group, "FusedAdam") for group in self.param_groups]
        for group, (params, grads_, exp_avgs, exp_avg_sqs, write_back) in zip(
            self.param_groups, lists
        ):
            if not params:
                continue
            beta1 = group["betas"][0]
            step = next_step(group)
            updates = adam_moments(
                params, grads_, exp_avgs, exp_avg_sqs, group, step, 1 - beta1, not self.adam_w_mode
            )
            if self.adam_w_mode and group["weight_decay"] != 0:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, updates, alpha=-group["lr"])
            write_back()
        return loss
