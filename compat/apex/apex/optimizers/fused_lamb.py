"""apex.optimizers.FusedLAMB: LAMB (You et al., arXiv:1904.00962) as apex computed it, with
torch._foreach_*:

1. the global gradient norm |g| over every parameter of every group; gradients are divided by
   |g| / max_grad_norm when |g| > max_grad_norm (pre-normalisation, not clipping afterwards);
2. Adam moments (m with beta3 = 1 - beta1, or 1 without grad_averaging) and bias correction;
   L2 decay (g + wd p) before the moments with adam_w_mode=False, decoupled decay
   (update + wd p) with adam_w_mode=True, apex's default;
3. the trust ratio: p -= lr * (|p| / |update|) * update, where both norms are non-zero and the
   group has weight decay (or use_nvlamb=True); p -= lr * update otherwise.
No host synchronisation: the norms and ratios stay tensors.
"""

import torch

from ._common import GradNoneDefault, adam_moments, float32_lists, next_step


class FusedLAMB(GradNoneDefault, torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        amsgrad=False,
        adam_w_mode=True,
        grad_averaging=True,
        set_grad_none=True,
        max_grad_norm=1.0,
        use_nvlamb=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant (as apex).")
        if not max_grad_norm > 0:
            raise ValueError(
                f"FusedLAMB: max_grad_norm must be positive; got {max_grad_norm!r} (apex divided "
                "the gradients by |g| / max_grad_norm, which is not defined for it)."
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lists = [float32_lists(self, group, "FusedLAMB") for group in self.param_groups]
        all_grads = [g for _, grads, _, _, _ in lists for g in grads]
        if not all_grads:
            return loss
        global_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(all_grads)))
        max_grad_norm = self.defaults["max_grad_norm"]  # apex read it from the defaults
        divisor = torch.where(global_norm > max_grad_norm, global_norm / max_grad_norm, 1.0)
        for group, (params, grads, exp_avgs, exp_avg_sqs, write_back) in zip(
            self.param_groups, lists
        ):
            if not params:
                continue
            beta1 = group["betas"][0]
            step = next_step(group)
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            grads = torch._foreach_div(grads, divisor)
            updates = adam_moments(
                params, grads, exp_avgs, exp_avg_sqs, group, step, beta3, not self.adam_w_mode
            )
            weight_decay, lr = group["weight_decay"], group["lr"]
            if self.adam_w_mode and weight_decay != 0:
                torch._foreach_add_(updates, params, alpha=weight_decay)
            if self.use_nvlamb or weight_decay != 0:
                param_norms = torch._foreach_norm(params)
                update_norms = torch._foreach_norm(updates)
                ratios = [
                    torch.where((p_norm != 0) & (u_norm != 0), lr * p_norm / u_norm, lr)
                    for p_norm, u_norm in zip(param_norms, update_norms)
                ]
                torch._foreach_mul_(updates, ratios)
                torch._foreach_sub_(params, updates)
            else:
                torch._foreach_add_(params, updates, alpha=-lr)
            write_back()
        return loss
