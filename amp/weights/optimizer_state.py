"""Optimizer state dicts that carry the O2 master weights, loaded validate-then-commit.

On a torch optimizer whose class keeps Optimizer's own state_dict and load_state_dict, torch's
state-dict hooks do it (`StateDictHooks`); on a wrapper (apex's LARC) or a class with its own
(ZeroRedundancyOptimizer's runs no hook), amp's replacements of the two methods call `saved`,
`loading` and `loaded` around the optimizer's own.
"""

import torch

from .. import kernels
from .._state import amp_state
from .compact_state import Form
from .masters import master_indices
from .snapshot import OptimizerSnapshot

__all__ = [
    "MASTER_PARAMS_KEY",
    "takes_hooks",
    "StateDictHooks",
    "saved",
    "loading",
    "loaded",
    "check_masters",
    "check_moments",
]

MASTER_PARAMS_KEY = "amp_master_params"


def takes_hooks(optimizer):
    """Whether torch's state-dict hooks run for `optimizer`'s state dicts (its class keeps
    Optimizer's own state_dict and load_state_dict)."""
    cls = type(optimizer)
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and cls.state_dict is torch.optim.Optimizer.state_dict
        and cls.load_state_dict is torch.optim.Optimizer.load_state_dict
    )


class StateDictHooks:
    """torch's state-dict hooks of one optimizer (`register` below): the masters of `table` in
    its state dicts, its state in `fused`'s form (fused_step.FusedStep, or None)."""

    def __init__(self, table, fused):
        self.table, self.fused = table, fused
        self.pending = None  # (masters to write, the state before) between the load's hooks

    def register(self, optimizer):
        """The hooks' handles (for amp's ledger to remove)."""
        return (
            optimizer.register_state_dict_post_hook(self.saved),
            optimizer.register_load_state_dict_pre_hook(self.loading),
            optimizer.register_load_state_dict_post_hook(self.loaded),
        )

    def saved(self, optimizer, state):
        return saved(optimizer, self.table, state)

    def loading(self, optimizer, state_dict):
        state_dict, self.pending = loading(optimizer, self.table, state_dict, self.fused)
        return state_dict

    def loaded(self, optimizer):
        pending, self.pending = self.pending, None
        loaded(optimizer, self.table, *pending)


def saved(optimizer, table, state):
    """The optimizer's own state dict `state`, with the masters of `table`: FP32, or compact
    masters' int8 corrections (compact on disk: the weights are the model's)."""
    if table.models:
        # A write into the model since the last step (a mask, a broadcast) is the masters' value
        # from then on; a checkpoint serialized before anything else looked must hold it.
        table.take_outside_writes()
        held = table.corrections if table.compact else table.masters
        state[MASTER_PARAMS_KEY] = {
            index: held[row].detach()
            for index, (row, _) in master_indices(optimizer.param_groups, table).items()
        }
    return state


def _form(fused):
    """The form the optimizer's state is kept in: the fused step's, torch's FP32 one for a step
    it knows (a checkpoint of compact state converts), or None."""
    if fused is None:
        return None
    return fused.form if fused.form is not None else Form(fused.kind, False, "fp32")


def loading(optimizer, table, state_dict, fused=None):
    """Before the optimizer's own load: (the state dict without the masters, its state entries
    in this run's form, (the masters to write after it, the optimizer's state before)), or a
    clear error, changing nothing.

    A checkpoint without the masters key (a plain FP32 one) loads: the masters keep the values
    they have (the model's, after `model.load_state_dict`). With the key, it must hold a master
    for every master here: a partial set would leave some at values from another run. FP32
    masters load into compact ones (encoded) and compact ones into FP32 ones (decoded with the
    model's weights: load the model first), as state of either form does.
    """
    plan = []
    if hasattr(state_dict, "get") and MASTER_PARAMS_KEY in state_dict:
        plan = check_masters(optimizer, table, state_dict[MASTER_PARAMS_KEY])
        state_dict = {k: v for k, v in state_dict.items() if k != MASTER_PARAMS_KEY}
    form = _form(fused)
    if form is not None and isinstance(state_dict.get("state"), dict):
        entries = state_dict["state"].items()
        state_dict = dict(state_dict, state={k: form.from_torch(v) for k, v in entries})
        check_moments(optimizer, state_dict, form)
    return state_dict, (plan, OptimizerSnapshot(optimizer), form)


def check_moments(optimizer, state_dict, form):
    """A clear error where a moment has another size than its parameter (a checkpoint of
    another model): torch's fused ops, which amp's step calls, do not check it, and would read
    past the moment's end or step a prefix of it. Changes nothing."""
    saved = [index for group in state_dict.get("param_groups", ()) for index in group["params"]]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if len(saved) != len(params):
        return  # torch's load refuses it: "... a different number of parameters ..."
    param_of = dict(zip(saved, params))
    for index, entry in state_dict["state"].items():
        param = param_of.get(index)
        if param is None or not isinstance(entry, dict):
            continue
        for moment, _ in form.moments:
            keys = form.keys(moment)
            value, scales = entry.get(keys[0]), entry.get(keys[-1]) if len(keys) == 2 else None
            wrong = isinstance(value, torch.Tensor) and value.shape != param.shape
            if isinstance(scales, torch.Tensor):
                wrong = wrong or scales.numel() != kernels.moment_scales(param.numel())
            if wrong:
                raise ValueError(
                    f"optimizer.load_state_dict: the {moment} of parameter {index} has shape "
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else None}"
                    + (f" and {scales.numel()} block scales" if scales is not None else "")
                    + f", and the parameter shape {tuple(param.shape)}: the checkpoint is of "
                    "another model. Load one saved by an optimizer over this model's parameters."
                )


def loaded(optimizer, table, plan, before, form=None):
    """After the optimizer's own load: the masters written (on an error the optimizer's state
    before comes back) and marked, with the model's weights; the moments in their form's dtypes
    again (torch's load casts every state tensor to its parameter's dtype)."""
    if plan:
        try:
            with torch.no_grad():
                for value, row in plan:
                    _write_master(table, row, value)
        except BaseException:  # what check_masters could not foresee: the old state stays
            before.restore()
            raise
        if not table.compact:
            with torch.no_grad():
                rows = [row for _, row in plan]
                models = [table.models[row] for row in rows]
                kernels.copy_([table.masters[row] for row in rows], models)
        table.mark()
    if form is not None and form.state != "fp32":
        for entry in optimizer.state.values():
            form.dtypes_restored(entry)
    table.forget_groups()
    amp_state.cast_cache.clear()


def _write_master(table, row, value):
    """A checkpoint's master into `row`: FP32 values, or a compact master's int8 correction."""
    compact_value = value.dtype is torch.int8
    if table.compact and compact_value:
        table.corrections[row].copy_(value)
    elif table.compact:
        table.set_value(row, value)
    elif compact_value:
        table.masters[row].copy_(kernels.compact_decode(table.models[row].detach(), value))
    else:
        table.masters[row].copy_(value)


def check_masters(optimizer, table, masters):
    """[(value, table row)] to write, or a clear error; changes nothing."""
    here = master_indices(optimizer.param_groups, table)
    if not isinstance(masters, dict):
        raise TypeError(
            f"optimizer.load_state_dict: {MASTER_PARAMS_KEY!r} must map parameter indices "
            f"to tensors; got {type(masters).__name__}. Drop the key to keep the current master "
            "weights (they follow the model's weights)."
        )
    plan = []
    for index, value in masters.items():
        if index not in here:
            raise ValueError(
                f"optimizer.load_state_dict: the checkpoint has an FP32 master weight for "
                f"parameter {index!r}, which is not an O2 master here (this optimizer has "
                f"masters for {sorted(here)}). Load it into an optimizer set up the same way."
            )
        row, master = here[index]
        if not isinstance(value, torch.Tensor) or value.shape != master.shape:
            raise ValueError(
                f"optimizer.load_state_dict: master weight {index} has shape "
                f"{getattr(value, 'shape', type(value).__name__)}, expected "
                f"{tuple(master.shape)}."
            )
        if not (value.is_floating_point() or value.dtype is torch.int8):
            raise ValueError(
                f"optimizer.load_state_dict: master weight {index} is {value.dtype}: neither "
                "floating (an FP32 master) nor int8 (a compact master's correction)."
            )
        if value.layout is not torch.strided or value.is_meta:
            # Caught here, before torch's load replaces the state: copy_ would fail after it.
            kind = "a meta tensor (no data)" if value.is_meta else f"a {value.layout} tensor"
            raise ValueError(
                f"optimizer.load_state_dict: master weight {index} is {kind}; the FP32 master "
                "weights load from dense tensors with data (as optimizer.state_dict() saves them)."
            )
        plan.append((value, row))
    missing = sorted(set(here) - set(masters))
    if missing:
        raise ValueError(
            f"optimizer.load_state_dict: the checkpoint's {MASTER_PARAMS_KEY!r} lacks the "
            f"master weights of parameters {missing} (it has {sorted(masters)}); they would keep "
            "this run's values. Load a checkpoint saved by an optimizer set up the same way, or "
            f"drop the {MASTER_PARAMS_KEY!r} key to take the masters from the model."
        )
    return plan
