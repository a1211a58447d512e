"""O2 master weights: the FP32 copies an optimizer steps in place of the model's low-precision
parameters, made at initialize (and when a parameter group joins), kept beside their parameters
by the optimizer's table (table.py), and given back at deinitialize."""

import torch

from .._state import amp_state
from .table import ParamTable, find

__all__ = [
    "new_master",
    "match_state_to_params",
    "frozen_table",
    "master_for",
    "join",
    "master_indices",
    "give_back",
]


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


def frozen_table():
    """The table of this initialize's cast parameters that no optimizer steps (made once)."""
    tables = amp_state.tables
    if not tables or not tables[-1].frozen:
        tables.append(ParamTable(frozen=True))
    return tables[-1]


def master_for(param):
    """The master a cast parameter gets when it joins an optimizer: its FP32 copy as a frozen
    parameter (its exact FP32 value, any write not yet taken over included), else a new one;
    None when an optimizer steps it already. Changes nothing."""
    table, row = find(param, amp_state.tables)
    if table is None:
        return new_master(param)
    if not table.frozen:
        return None
    table.sync_row(row)
    return table.masters[row]


def join(table, param, master):
    """A cast parameter joins the optimizer of `table` (add_param_group) with `master`
    (master_for's): its frozen FP32 copy, if it had one, leaves the frozen table."""
    frozen, _ = find(param, amp_state.tables)
    if frozen is not None:
        frozen.pop_master(param)
    table.add_master(param, master)
    table.mark_row(len(table.models) - 1)


def master_indices(groups, table):
    """{index in the optimizer's state dict: (model param, master)} for every master."""
    found = {}
    rows = map(table.master_index.get, (id(p) for group in groups for p in group["params"]))
    for index, row in enumerate(rows):
        if row is not None:
            found[index] = (table.models[row], table.masters[row])
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
