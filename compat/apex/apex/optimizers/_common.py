"""What apex's fused optimizers share: `set_grad_none`, parameters grouped for torch._foreach_*
arithmetic in float32, and the refusal of step()'s pre-2019 arguments."""

import torch


class GradNoneDefault:
    """zero_grad() sets gradients to None or zeroes them as `set_grad_none` says (apex's
    argument); an explicit `set_to_none` wins."""

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


def refuse_old_step_arguments(name, **arguments):
    given = sorted(key for key, value in arguments.items() if value is not None)
    if given:
        raise RuntimeError(
            f"{name}.step() takes no {', '.join(given)}: apex dropped these arguments in 2019. "
            "Create the optimizer as a torch.optim optimizer and call step() with no arguments "
            "(amp unscales the gradients)."
        )


def float32_lists(optimizer, group, name):
    """The group's parameters with gradients, with their gradients and their moment buffers
    (created on first use), each as float32 tensors; `write_back()` copies the parameters and
    buffers of other dtypes back, as apex's kernels computed in float32 and stored in place."""
    params, grads, exp_avgs, exp_avg_sqs = [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{name} does not support sparse gradients (as apex).")
        if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise RuntimeError(
                f"{name} supports float32, float16 and bfloat16 parameters; got {p.dtype}."
            )
        state = optimizer.state[p]
        if len(state) == 0:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
    stored = params + exp_avgs + exp_avg_sqs
    working = [t if t.dtype is torch.float32 else t.float() for t in stored]
    grads = [g if g.dtype is torch.float32 else g.float() for g in grads]
    n = len(params)

    def write_back():
        for original, value in zip(stored, working):
            if original is not value:
                original.copy_(value)

    return working[:n], grads, working[n : 2 * n], working[2 * n :], write_back


def adam_moments(params, grads, exp_avgs, exp_avg_sqs, group, step, beta3, l2_decay):
    """The Adam update direction of apex's kernels, in place of new tensors:
    (m / bc1) / (sqrt(v / bc2) + eps), after m = b1 m + beta3 g, v = b2 v + (1 - b2) g^2, with
    the L2 term wd * p added to g first when `l2_decay`."""
    beta1, beta2 = group["betas"]
    weight_decay = group["weight_decay"]
    if l2_decay and weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=beta3)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if group["bias_correction"]:
        correction1, correction2 = 1 - beta1**step, 1 - beta2**step
    else:
        correction1 = correction2 = 1.0
    denominators = torch._foreach_div(exp_avg_sqs, correction2)
    torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, group["eps"])
    updates = torch._foreach_div(exp_avgs, correction1)
    torch._foreach_div_(updates, denominators)
    return updates


def next_step(group):
    """apex counted steps per group (`group['step']`), which apex checkpoints carry."""
    group["step"] = group.get("step", 0) + 1
    return group["step"]
