"""What `amp.initialize` may change on models and optimizers, held by reference so that a failed
initialize puts back the very objects it found, whatever failed and whatever its undo did.

The ledger's undo brings values back (the O2 masters are exact copies), but O3 keeps no FP32 copy
and an undo can itself fail half-way; the snapshot holds the original tensors, state dicts and
lists, so putting them back is exact by identity and cannot fail. It keeps the original FP32
parameter storage alive until initialize returns.
"""

import torch

from ..distributed import set_data
from . import shards

__all__ = ["Snapshot", "OptimizerSnapshot"]


class Snapshot:
    def __init__(self, models, optimizers):
        params = {}
        self._models = models
        self._buffers = []
        for model in models:
            for module in model.modules():
                if type(module._parameters) is not dict or type(module._buffers) is not dict:
                    continue  # not an eager module (a ScriptModule): amp does not change it
                for param in module._parameters.values():
                    if param is not None:
                        params[id(param)] = param
                self._buffers.append((module._buffers, dict(module._buffers)))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    params.setdefault(id(param), param)
        self._params = [(param, param.data, param.grad) for param in params.values()]
        self._optimizers = [OptimizerSnapshot(optimizer) for optimizer in optimizers]

    def restore(self):
        with torch.no_grad():
            for param, data, grad in self._params:
                set_data(param, data)  # first: a gradient must match its parameter's dtype
                param.grad = grad
        for buffers, saved in self._buffers:
            buffers.clear()
            buffers.update(saved)
        for model in self._models:
            shards.resync(model)
        for optimizer in self._optimizers:
            optimizer.restore()


class OptimizerSnapshot:
    """An optimizer's attributes, param groups (their dicts and "params" lists) and state."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self._attributes = dict(vars(optimizer))
        self._groups = list(optimizer.param_groups)
        self._group_items = [dict(group) for group in self._groups]
        self._group_params = [list(group["params"]) for group in self._groups]
        self._state = optimizer.state
        self._state_items = [(key, value, dict(value)) for key, value in optimizer.state.items()]

    def restore(self):
        attributes = vars(self._optimizer)
        attributes.clear()
        attributes.update(self._attributes)
        self._optimizer.param_groups[:] = self._groups
        for group, items, params in zip(self._groups, self._group_items, self._group_params):
            group.clear()
            group.update(items)
            group["params"][:] = params
        self._state.clear()
        for key, value, items in self._state_items:
            value.clear()
            value.update(items)
            self._state[key] = value
