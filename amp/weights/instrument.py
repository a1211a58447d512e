"""Setting an optimizer up for amp: at O2 the owner of the cast parameters it steps, on the path
paths.choose decides for its groups (owner.py or copies.py); its OptimizerRecord (optimizer.py)
attached; its step, zero_grad, add_param_group and state dicts replaced by the record's
(optimizer.py's `replacement`); its state dicts carrying the masters (optimizer_state.py); all
undone by amp's ledger."""

import inspect

import torch

from .._state import amp_state
from ..apex_interop.optimizer_wrappers import require_optimizer_like
from . import engines, optimizer_state, paths
from .copies import MasterCopies, new_master
from .forms import StateForm
from .optimizer import PATCHED_METHODS, OptimizerRecord, replacement
from .owner import StateOwner
from .paths import FUSED, GENERAL, choose, master_form

__all__ = ["check_optimizer", "takes_found_inf", "instrument", "match_state_to_params"]


def check_optimizer(optimizer, index):
    require_optimizer_like(optimizer, f"amp.initialize: optimizers[{index}]")
    if "_amp_record" in vars(optimizer):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")


def takes_found_inf(optimizer):
    """Whether `optimizer.step` takes the overflow flag on the device: torch's fused optimizers
    (`_step_supports_amp_scaling`), whose step reads `found_inf` (not the older form that takes
    the scaler as `grad_scaler=`)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return "grad_scaler" not in inspect.signature(optimizer.step).parameters


def instrument(optimizer, index, cast_ids, properties, ledger):
    """Set `optimizer` (optimizers[index]) up for amp: at O2 the owner of the cast parameters
    it steps (`cast_ids`; FP32 still), its path chosen (`choose`); its methods patched, its state
    dicts carrying the masters. Runs before the model is cast."""
    owner = None
    if properties.master_weights and cast_ids:
        chosen = [
            choose(optimizer, group, properties, f"optimizers[{index}].param_groups[{number}]")
            for number, group in enumerate(optimizer.param_groups)
        ]
        path = FUSED if all(p == FUSED for p, _ in chosen) else GENERAL
        owner = _owner(optimizer, cast_ids, properties, path)
    if owner is None:  # O3's: state made with FP32 parameters follows them, as torch's load does
        ledger.add_undo(
            "optimizer state in the parameters' dtype", lambda: match_state_to_params(optimizer)
        )
    else:
        ledger.add_undo("optimizer state in torch's own form", owner.give_back)
        amp_state.rows.append(owner)
    hooked = optimizer_state.takes_hooks(optimizer)
    originals = {
        name: getattr(optimizer, name)
        for name in PATCHED_METHODS
        # add_param_group is optional for an optimizer wrapper (apex_interop/optimizer_wrappers.py)
        if (name != "add_param_group" or hasattr(optimizer, name))
        and not (hooked and name in ("state_dict", "load_state_dict"))
    }
    record = OptimizerRecord(optimizer, originals, owner, takes_found_inf(optimizer))
    if isinstance(owner, MasterCopies):
        engines.follow_masters(optimizer, list(zip(owner.params, owner.masters)), ledger)
    if hooked and owner is not None:
        for handle in optimizer_state.StateDictHooks(owner).register(optimizer):
            ledger.add_hook(handle, "optimizer state dict hook")
    for name in originals:
        ledger.patch(
            optimizer, name, lambda original, name=name: replacement(optimizer, name, original)
        )
    vars(optimizer)["_amp_record"] = record
    ledger.add_undo("forget the optimizer", lambda: vars(optimizer).pop("_amp_record", None))
    return record


def _owner(optimizer, cast_ids, properties, path):
    groups = optimizer.param_groups
    if path == FUSED:
        kind = paths.kind_of(optimizer)
        form = StateForm(kind, master_form(properties, FUSED), properties.optimizer_state)
        owner = StateOwner(optimizer, kind, form)
        params = [p for group in groups for p in group["params"]]
        for number, param in enumerate(params):  # state loaded before: its form (FP32 params)
            owner.convert_state(param, number)
        for param in params:
            if id(param) in cast_ids and id(param) not in owner.index:
                owner.add(param)
        return owner
    owner = MasterCopies(optimizer, properties.cast_model_type)
    state = optimizer.state
    for group in groups:
        for position, param in enumerate(group["params"]):
            if param in state:  # a checkpoint of the fused path's forms: torch's format
                state[param] = optimizer_state.in_torch_form(state[param], param)
            if id(param) in cast_ids and id(param) not in owner.index:
                master = new_master(param)
                param.grad = None
                group["params"][position] = master
                if param in state:
                    state[master] = state.pop(param)
                owner.add(param, master)
    return owner


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
