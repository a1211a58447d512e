"""apex.parallel.LARC: layer-wise adaptive rate control around any optimizer (You, Gitman and
Ginsburg, arXiv:1708.03888), with apex's arguments and arithmetic.

For each parameter with a gradient, when both norms are non-zero:
    local_lr = trust_coefficient * |p| / (|g| + weight_decay * |p| + eps)
clip=True uses min(local_lr, lr) as the step size (the gradient is scaled by
min(local_lr / lr, 1)); clip=False scales the step by local_lr. The group's weight decay is
folded into the gradient first (g + weight_decay * p) and set to 0 while the wrapped optimizer
steps, then restored.
"""

import torch


class LARC:
    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self):
        return self.optim.__getstate__()

    def __setstate__(self, state):
        self.optim.__setstate__(state)

    def __repr__(self):
        return self.optim.__repr__()  # as apex

    @property
    def state(self):
        return self.optim.state

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    @property
    def defaults(self):
        return self.optim.defaults

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    def step(self, closure=None):
        weight_decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                weight_decay = group.get("weight_decay", 0)
                weight_decays.append(weight_decay)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    param_norm, grad_norm = torch.norm(p), torch.norm(p.grad)
                    if param_norm != 0 and grad_norm != 0:
                        local_lr = (
                            self.trust_coefficient
                            * param_norm
                            / (grad_norm + param_norm * weight_decay + self.eps)
                        )
                        if self.clip:
                            local_lr = torch.clamp(local_lr / group["lr"], max=1)
                        p.grad.add_(p, alpha=weight_decay)
                        p.grad.mul_(local_lr)
        try:
            return self.optim.step() if closure is None else self.optim.step(closure)
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay
