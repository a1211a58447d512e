"""optimizer.add_param_group at O2: the cast parameters no optimizer stepped yet (a frozen layer
thawed: initialize's frozen rows hold their rests) join the optimizer's owner with their masters;
a parameter another optimizer steps, or this one already, is refused; so is a group the fused
step could not step where it steps the others (an optimizer's groups share one path:
paths.choose)."""

import torch

from .._state import amp_state
from . import engines, paths
from .copies import MasterCopies, new_master
from .owner import StateOwner

__all__ = ["add_param_group"]


def add_param_group(record, param_group):
    """The optimizer's add_param_group, for its OptimizerRecord `record` (the module doc)."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param group must be a dict; got {type(param_group).__name__}.")
    params = param_group.get("params")
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs. Please use a list instead."
        )
    else:
        params = list(params) if params is not None else params
    group = dict(param_group, params=params)
    owner = record.owner
    joining = []
    if owner is not None:
        for param in params or ():
            rows = amp_state.owners.get(id(param))
            if rows is not None and rows is not owner and not hasattr(rows, "optimizer"):
                joining.append((param, rows))  # a frozen cast parameter joins
            elif rows is not None:
                raise ValueError(_stepped_already(param, rows is owner))
        if joining and isinstance(owner, StateOwner):  # the fused step steps every group
            where = "optimizer.add_param_group"
            with_defaults = {**record.optimizer.defaults, **group}  # as torch will fill it
            path, reason = paths.choose(
                record.optimizer, with_defaults, amp_state.properties, where, owner.kind
            )
            if path != paths.FUSED:
                raise ValueError(
                    f"{where}: the new group is one amp's fused step cannot step "
                    f"({reason}), and it steps this {type(record.optimizer).__name__}'s other "
                    "groups: an optimizer's groups share one path. Give it options the "
                    "fused step computes, or pass every group to amp.initialize (an "
                    "optimizer with such a group is then stepped by its own step)."
                )
    masters = {}
    if isinstance(owner, MasterCopies):
        for param, _ in joining:
            masters[id(param)] = master = new_master(param)
            group["params"][group["params"].index(param)] = master
    record.originals["add_param_group"](group)
    for param, frozen in joining:
        rest = frozen.pop(param)
        if isinstance(owner, StateOwner):
            owner.add(param, rest)
        else:
            master = masters[id(param)]
            master.data = frozen.form.decode(param.detach(), rest).float()
            master.requires_grad_(param.requires_grad)
            owner.add(param, master)
    record._plain = (None, [])
    engines.anchor([record], amp_state.models)


def _stepped_already(param, here):
    """add_param_group's error for a cast parameter an optimizer steps."""
    if here:  # torch's words
        return "some parameters appear in more than one parameter group"
    return (
        "optimizer.add_param_group: the parameter is stepped by another optimizer passed to "
        "amp.initialize (with its master weight at O2); amp unscales and steps each "
        "parameter through one optimizer. Add it to that optimizer, or leave it out here."
    )
