"""Setting an optimizer up for amp: its FP32 masters made (O2), its OptimizerRecord (optimizer.py)
attached, its step, zero_grad and add_param_group replaced by the record's (optimizer.py's
`replacement`), its state dicts made to carry the masters (optimizer_state.py), all undone by
amp's ledger."""

import inspect

from .. import kernels
from .._state import amp_state
from ..apex_interop.optimizer_wrappers import require_optimizer_like
from . import engines, masters, optimizer_state
from .deferral import Deferral
from .fused_step import FusedStep
from .optimizer import PATCHED_METHODS, OptimizerRecord, replacement
from .table import ParamTable

__all__ = ["check_optimizer", "takes_found_inf", "instrument"]

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


def instrument(optimizer, params_with_masters, ledger, compact=False, state="fp32"):
    """Set `optimizer` up for amp: masters for `params_with_masters` (ids; FP32, or `compact`),
    patched methods, its moments kept as `state` says (compact_state.py).

    Must run before the model is cast, so the masters are the exact FP32 weights.
    """
    # Runs last on undo, after the model has its FP32 weights back.
    ledger.add_undo(
        "optimizer state in the parameters' dtype",
        lambda: masters.match_state_to_params(optimizer),
    )
    table = ParamTable(compact=compact)
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            if id(param) in params_with_masters:
                if compact:
                    master, correction = masters.compact_master(param)
                else:
                    master, correction = masters.new_master(param), None
                param.grad = None
                group["params"][index] = master
                if param in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(param)
                table.add_master(param, master, correction)
    hooked = optimizer_state.takes_hooks(optimizer)
    originals = {
        name: getattr(optimizer, name)
        for name in PATCHED_METHODS
        # add_param_group is optional for an optimizer wrapper (apex_interop/optimizer_wrappers.py)
        if (name != "add_param_group" or hasattr(optimizer, name))
        and not (hooked and name in ("state_dict", "load_state_dict"))
    }
    fused = deferral = None
    if table.models:
        fused = FusedStep.made_for(optimizer, originals["step"], compact, state)
        if fused is not None and fused.form is not None:  # compact state: kept low, any backend
            deferral = Deferral(type(table.masters[0]))
            _state_in_form(optimizer, fused.form, ledger)
        elif fused is not None and kernels.fuses(table.masters[0].device):
            deferral = Deferral()
    record = OptimizerRecord(
        optimizer, originals, table, fused, deferral, takes_found_inf(optimizer)
    )
    if params_with_masters:  # a group added later may bring masters too
        ledger.add_undo("optimizer steps its model parameters again", record.give_back)
    if table.models:
        engines.follow_masters(optimizer, list(zip(table.models, table.masters)), ledger)
    amp_state.tables.append(table)
    if hooked:
        record.state_hooks = optimizer_state.StateDictHooks(table, fused)
        for handle in record.state_hooks.register(optimizer):
            ledger.add_hook(handle, "optimizer state dict hook")
    for name in originals:
        ledger.patch(
            optimizer, name, lambda original, name=name: replacement(optimizer, name, original)
        )
    vars(optimizer)["_amp_record"] = record
    ledger.add_undo("forget the optimizer", lambda: vars(optimizer).pop("_amp_record", None))
    return record


def _state_in_form(optimizer, form, ledger):
    """State the optimizer holds already (a load before initialize) in `form`; torch's FP32
    format again at deinitialize (which runs this undo after the masters went back)."""
    state = optimizer.state
    ledger.add_undo(
        "optimizer state in torch's format",
        lambda: state.update({key: form.to_torch(entry) for key, entry in state.items()}),
    )
    state.update({key: form.from_torch(entry) for key, entry in state.items()})
