"""O2 master weights: the FP32 copies an optimizer steps in place of the model's low-precision
parameters, made at initialize (and when a parameter group joins), kept beside their parameters
by the optimizer's table (table.py), and given back at deinitialize."""

import torch

from .. import kernels
from .._state import amp_state
from .table import ParamTable, find, hollow

__all__ = [
    "HollowMaster",
    "compact_master",
    "new_master",
    "match_state_to_params",
    "frozen_table",
    "master_for",
    "join",
    "master_indices",
    "give_back",
]


class HollowMaster(torch.nn.Parameter):
    """The master of a compact row (master_weights="compact"): a Parameter of the weight's shape
    that holds no values (a NaN at every index), for the optimizer to step (in its param groups,
    its state's key) and to hold the FP32 gradient. The value is the bf16 weight and its int8
    correction in the optimizer's table. A copy is hollow too."""

    def __deepcopy__(self, memo):  # as Parameter's (no gradient), but hollow too
        copied = memo[id(self)] = HollowMaster(hollow(self.shape, self.device), self.requires_grad)
        return copied


def compact_master(param):
    """(a HollowMaster for `param`, the int8 correction of its FP32 value); `param`'s own cast to
    bf16 is the weight (kernels.compact_encode's)."""
    master = HollowMaster(hollow(param.shape, param.device), param.requires_grad)
    _, correction = kernels.compact_encode(param.detach().float())
    if param.grad is not None:
        master.grad = param.grad.detach().float()
    return master, correction


def new_master(param):
    """An FP32 copy of `param`, as a Parameter so that an optimizer can step it."""
    master = torch.nn.Parameter(param.detach().clone().float(), requires_grad=param.requires_grad)
    if param.grad is not None:
        master.grad = param.grad.detach().float()
    return master


def match_state_to_params(optimizer):
    """Cast floating optimizer state to its parameter's dtype, as torch's load_state_dict does."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if (
                key != "step"
                and isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and value.dtype != param.dtype
            ):
                state[key] = value.to(param.dtype)


def frozen_table(compact=False):
    """The table of this initialize's cast parameters that no optimizer steps (made once)."""
    tables = amp_state.tables
    if not tables or not tables[-1].frozen:
        tables.append(ParamTable(frozen=True, compact=compact))
    return tables[-1]


def master_for(param, compact=False):
    """(the master, its correction or None) a cast parameter gets when it joins an optimizer:
    its FP32 copy (or compact master) as a frozen parameter, any write not yet taken over
    included, else a new one; None when an optimizer steps it already. Changes nothing."""
    table, row = find(param, amp_state.tables)
    if table is None:
        return compact_master(param) if compact else (new_master(param), None)
    if not table.frozen:
        return None
    table.sync_row(row)
    return table.masters[row], (table.corrections[row] if table.compact else None)


def join(table, param, master, correction=None):
    """A cast parameter joins the optimizer of `table` (add_param_group) with `master` and
    `correction` (master_for's): its frozen row, if it had one, leaves the frozen table."""
    frozen, _ = find(param, amp_state.tables)
    if frozen is not None:
        frozen.pop_master(param)
    table.add_master(param, master, correction)
    table.mark_row(len(table.models) - 1)


def master_indices(groups, table):
    """{index in the optimizer's state dict: (its row in `table`, master)} for every master."""
    found = {}
    rows = map(table.master_index.get, (id(p) for group in groups for p in group["params"]))
    for index, row in enumerate(rows):
        if row is not None:
            found[index] = (row, table.masters[row])
    return found


def give_back(optimizer, table):
    """Undo of master creation: the optimizer steps the model's own parameters again (an FP32
    model parameter takes its master's gradient)."""
    for group in optimizer.param_groups:
        params = group["params"]
        group["params"] = [
            param if model is None else model
            for param, model in zip(params, table.models_of(params))
        ]
    state = optimizer.state
    for model_param, master in zip(table.models, table.masters):
        if master in state:
            state[model_param] = state.pop(master)
        if model_param.dtype is torch.float32:
            model_param.grad = master.grad
    table.clear_masters()
    table.forget_groups()
