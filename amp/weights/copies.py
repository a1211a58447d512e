"""O2 master weights for an optimizer amp does not step (anything but torch's AdamW, Adam and SGD,
or those with options the fused step does not compute, or AMP_FUSED_STEP=0): FP32 copies of the
cast parameters, in the optimizer's param groups as Parameters with real values, stepped by its
own step (apex's way; ZeroRedundancyOptimizer partitions them: engines.py). After each step
their values are written into the model, rounded to nearest even.

Their gradients are the masters' `.grad`, FP32 and unscaled, which the optimizer's own step
reads; `amp.master_params` yields the masters themselves.
"""

import torch

from .. import kernels
from .._state import amp_state
from .columns import GRAD, NONES, consume, repeat
from .rows import FP32, MasterForm, Rows

__all__ = ["MasterCopies", "new_master"]


def new_master(param):
    """An FP32 copy of `param`, as a Parameter so that an optimizer can step it (its gradient
    FP32 too)."""
    master = torch.nn.Parameter(param.detach().clone().float(), requires_grad=param.requires_grad)
    if param.grad is not None:
        master.grad = param.grad.detach().float()
    return master


class MasterCopies(Rows):
    """The FP32 masters of one optimizer (`masters`, the rows' rests), in its param groups."""

    # What an owner amp steps holds for a step; the optimizer's own step reads the masters' FP32
    # gradients.
    kept, copies, handed, grads, _handed_weak, grads_in_model = None, None, None, None, None, False
    sharded = False  # FSDP2 at O2 takes the fused path only (weights/shards.py)

    def __init__(self, optimizer, dtype):
        super().__init__(MasterForm(FP32, dtype))
        self.optimizer = optimizer
        self.masters = []
        self.master_index = {}  # id(master) -> its row

    def rests(self):
        return self.masters

    def rest(self, row):
        return self.masters[row]

    def set_rest(self, row, rest):
        self.masters[row].data = rest  # the master keeps its identity: the optimizer holds it

    def add(self, param, master):
        """A row for the cast parameter `param` (low precision now) and its FP32 `master`."""
        self.masters.append(master)
        row = self._add(param)
        self.master_index[id(master)] = row
        self.mark_row(row)
        amp_state.owners[id(param)] = self
        return row

    def follow(self, row):
        """The row's master (its data: the optimizer holds it), its gradient and its optimizer
        state onto its parameter's device (the model moved)."""
        master, device = self.masters[row], self.params[row].device
        master.data = master.data.to(device)
        if master.grad is not None:
            master.grad = master.grad.to(device)
        entry = self.optimizer.state.get(master)
        if entry:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and not (key == "step" and value.is_cpu):
                    entry[key] = value.to(device)

    def model_of(self, param):
        """The model parameter of a master (None for a parameter that is none)."""
        row = self.master_index.get(id(param))
        return None if row is None else self.params[row]

    # -- the parameters, the gradients ------------------------------------------------------------

    def plain(self, groups):
        """The parameters of `groups` that are no masters."""
        index = self.master_index
        return [p for group in groups for p in group["params"] if id(p) not in index]

    def master_grads(self):
        return list(map(GRAD, self.masters))

    def set_master_grads(self, rows, grads):
        consume(map(setattr, map(self.masters.__getitem__, rows), repeat("grad"), grads))

    def keeps_on(self, device):
        return False

    def place_copies(self, rows):
        pass

    def materialize(self):
        pass

    def drop_grads(self, zero=False):
        if zero:
            for master in self.masters:
                if master.grad is not None:
                    master.grad.zero_()
        else:
            consume(map(setattr, self.masters, repeat("grad"), NONES))

    def master_params(self):
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    # -- the step ---------------------------------------------------------------------------------

    def write_models(self):
        """After the optimizer stepped the masters: the model takes their values (rounded to
        nearest even), amp's own write."""
        # torch.no_grad() inlined: its context manager's calls would run at every step.
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            kernels.copy_(self.masters, self.params, check=False)
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        self.written_by_amp()

    # -- undo ---------------------------------------------------------------------------------

    def give_back(self):
        """deinitialize (after the model has its FP32 weights back): the optimizer steps the
        model's own parameters again, with the masters' state and (FP32 parameters) gradients."""
        models = self.master_index
        for group in self.optimizer.param_groups:
            group["params"] = [
                p if id(p) not in models else self.params[models[id(p)]] for p in group["params"]
            ]
        state = self.optimizer.state
        for param, master in zip(self.params, self.masters):
            if master in state:
                state[param] = state.pop(master)
            if param.dtype is torch.float32:
                param.grad = master.grad
            amp_state.owners.pop(id(param), None)
