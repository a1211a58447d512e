"""An optimizer wrapper shaped like apex's LARC (apex/parallel/LARC.py), written for the tests.

It is not a torch.optim.Optimizer: it holds one, forwards param_groups / state / state_dict /
load_state_dict / add_param_group to it, has a zero_grad that takes no argument, and its step
rescales each gradient by a layer-wise trust ratio before the wrapped optimizer steps (clip mode:
the effective learning rate is min(lr, trust * |p| / |g|)).
"""

import torch


class TrustRatio:
    def __init__(self, optimizer, trust_coefficient=0.02, eps=1e-8):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.steps_taken = 0  # how often step() ran for real (amp skips it on overflow)

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.optim.param_groups = groups

    @property
    def state(self):
        return self.optim.state

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self):  # no set_to_none, as in apex's LARC
        self.optim.zero_grad()

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def step(self):
        self.steps_taken += 1
        for group in self.optim.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                param_norm, grad_norm = param.norm(), param.grad.norm()
                if param_norm != 0 and grad_norm != 0:
                    ratio = self.trust_coefficient * param_norm / (grad_norm + self.eps)
                    param.grad.mul_(torch.clamp(ratio / group["lr"], max=1.0))
        self.optim.step()
