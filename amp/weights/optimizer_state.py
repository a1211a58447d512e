"""Optimizer state dicts at O2, loaded validate-then-commit.

On the fused path (owner.py) the state dict is the optimizer's own (each parameter's moments in
their form, its step) with each cast parameter's master's rest added to its entry
(`master_remainder`, `master_correction` or, for fp16 models, `master`). On the general path
(copies.py) each master's FP32 value is added under `master` (the masters are no model
parameters: torch's state dict does not hold their values). An entry's rest is the rest of the
model's weight, so a checkpoint is loaded model first, then optimizer (as torch's distributed
checkpoint's `set_state_dict` does).

Saving only reads: a row whose weight was written from outside amp since its last step saves the
rest that write left (none), not the live one. A load converts each entry to this run's form
(another form's rest is decoded with the model's weight and encoded in this one; moments of any
form; older amp's top-level `amp_master_params`), checks the shapes, then lets the optimizer's
own load run and puts the converted tensors in place (torch's load casts every state tensor to
its parameter's dtype, int16 remainders and FP32 moments of bf16 parameters too). A checkpoint
without masters (a plain torch one) keeps the masters as they are. Nothing changes on an error.

On a torch optimizer whose class keeps Optimizer's own state_dict and load_state_dict, torch's
state-dict hooks do it (`StateDictHooks`); on a wrapper (apex's LARC) or a class with its own
(ZeroRedundancyOptimizer's runs no hook), amp's replacements of the two methods call `saved`,
`loading` and `loaded` around the optimizer's own.
"""

import torch

from .. import distributed
from .._state import amp_state
from .copies import MasterCopies
from .forms import check_entry, torch_entry
from .rows import FP32, MasterForm
from .snapshot import OptimizerSnapshot

__all__ = [
    "MASTER_PARAMS_KEY",
    "takes_hooks",
    "in_torch_form",
    "StateDictHooks",
    "saved",
    "loading",
    "loaded",
]

MASTER_PARAMS_KEY = "amp_master_params"  # older amp's masters, {index: FP32 or int8}: loaded
_REST_KEYS = tuple(MasterForm.KEYS.values())
_DECODERS = {key: MasterForm(name, torch.bfloat16) for name, key in MasterForm.KEYS.items()}


def in_torch_form(entry, param):
    """A state entry of any form (a checkpoint of the fused path) in torch's format for `param`."""
    return torch_entry(entry, param.dtype)


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
    """torch's state-dict hooks of one optimizer (`register` below), for its `owner`."""

    def __init__(self, owner):
        self.owner = owner
        self.pending = None  # what a load's post-hook puts in place

    def register(self, optimizer):
        """The hooks' handles (for amp's ledger to remove)."""
        return (
            optimizer.register_state_dict_post_hook(self.saved),
            optimizer.register_load_state_dict_pre_hook(self.loading),
            optimizer.register_load_state_dict_post_hook(self.loaded),
        )

    def saved(self, optimizer, state):
        return saved(optimizer, self.owner, state)

    def loading(self, optimizer, state_dict):
        state_dict, self.pending = loading(optimizer, self.owner, state_dict)
        return state_dict

    def loaded(self, optimizer):
        pending, self.pending = self.pending, None
        loaded(optimizer, self.owner, pending)


def _params(optimizer):
    return [param for group in optimizer.param_groups for param in group["params"]]


def _by_position(state_dict):
    """`state_dict` with its parameters named by their position in its groups, as torch's own
    state dict names them: torch's load maps whatever names the groups list to the parameters
    in order (torch's distributed checkpoint names them by their qualified names)."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        return state_dict
    names = [name for group in groups for name in group.get("params", ())]
    if names == list(range(len(names))):
        return state_dict
    try:
        position = {name: index for index, name in enumerate(names)}
    except TypeError:  # unhashable names: torch's load says what is wrong
        return state_dict
    state_dict["param_groups"] = [
        dict(group, params=[position[name] for name in group.get("params", ())])
        for group in groups
    ]
    entries = state_dict["state"]
    state_dict["state"] = {position.get(key, key): entry for key, entry in entries.items()}
    return state_dict


def saved(optimizer, owner, state):
    """The optimizer's own state dict `state` with the masters (see the module doc); the live
    state is not touched."""
    entries = state["state"]
    general = isinstance(owner, MasterCopies)
    for index, param in enumerate(_params(optimizer)):
        row = (owner.master_index if general else owner.index).get(id(param))
        if row is None:
            continue
        if general:
            entries[index] = dict(entries.get(index, {}), master=owner.value(row).detach())
        else:  # as its value has it now (a write not yet taken in included)
            entry = entries.get(index, {})
            entries[index] = dict(entry, **{owner.form.key: _gatherable(owner.saved_rest(row))})
    return state


def _gatherable(rest):
    """A rest as a state dict holds it: a sharded int16 remainder (FSDP2's DTensor) widened to
    int32, exactly, since torch's collectives gather no int16 (neither gloo nor NCCL has it) and
    torch gathers the shards for a full state dict; a load narrows it back."""
    if rest.dtype is torch.int16 and distributed.has_dtensors((rest,)):
        return rest.to(torch.int32)
    return rest


def loading(optimizer, owner, state_dict):
    """Before the optimizer's own load: (the state dict to load, what `loaded` puts in place), or
    a clear error, changing nothing."""
    if not hasattr(state_dict, "get") or not isinstance(state_dict.get("state"), dict):
        return state_dict, None  # torch's load says what is wrong
    state_dict = _by_position(dict(state_dict))
    entries = dict(state_dict["state"])
    if MASTER_PARAMS_KEY in state_dict:
        _merge_older(entries, state_dict.pop(MASTER_PARAMS_KEY))
    params = _params(optimizer)
    saved_count = sum(len(group["params"]) for group in state_dict.get("param_groups", ()))
    if saved_count != len(params):
        state_dict["state"] = entries
        return state_dict, None  # torch's load refuses it: "... a different number of ..."
    owner.take_writes()  # a write not yet taken in is not lost to the load
    general = isinstance(owner, MasterCopies)
    rows_of = owner.master_index if general else owner.index
    with_rest = {i for i, entry in entries.items() if _rest_key(entry) is not None}
    cast = {i for i, param in enumerate(params) if id(param) in rows_of}
    if with_rest and cast - with_rest:
        raise ValueError(
            "optimizer.load_state_dict: the checkpoint holds the master weights of parameters "
            f"{sorted(with_rest & cast)} but lacks those of {sorted(cast - with_rest)}: they "
            "would keep this run's values. Load a checkpoint saved by an optimizer set up the same "
            "way, or one without masters (they then keep the model's values)."
        )
    converted, writes, rests, rests_alone = {}, [], [], []
    for index, entry in entries.items():
        if not (isinstance(index, int) and 0 <= index < len(params)):
            raise ValueError(
                f"optimizer.load_state_dict: the checkpoint holds state for parameter {index!r}, "
                f"and this optimizer has {len(params)} parameters: the checkpoint is of another "
                "model. Load one saved by an optimizer over this model's parameters."
            )
        if not isinstance(entry, dict):
            continue
        param = params[index]
        row = rows_of.get(id(param))
        key = _rest_key(entry)
        if key is not None and row is None:
            raise ValueError(
                f"optimizer.load_state_dict: the checkpoint holds a master weight ({key}) for "
                f"parameter {index}, which is not an O2 master here (this optimizer has masters "
                f"for {sorted(cast)}). Load it into an optimizer set up the same way."
            )
        if key is not None:
            _check_rest(entry[key], param, index, key)
        check_entry(entry, param, index)
        if general:
            if row is not None and key is not None:
                low = owner.params[row].detach()  # the weight beside the master it replaces
                writes.append((row, _DECODERS[key].decode(low, entry[key].to(_rest_dtype(key)))))
            entries[index] = converted[index] = torch_entry(entry, param.dtype)
            continue
        form = owner.state_form
        in_form = form.in_form(param, row is not None)
        entry = dict(entry)
        if key is not None:
            entry[key] = entry[key].to(_rest_dtype(key))
        low = param.detach() if row is not None else None
        new = form.from_torch(entry, param, in_form, low=low)
        rest = new.pop(form.master.key, None)  # the owner holds it; none: it stays as it is
        if row is not None and rest is not None:
            rests.append((row, rest))
        if new:
            entries[index] = converted[index] = new
        else:  # a rest alone: the parameter has no state until its first step
            rests_alone.append(index)
    for index in rests_alone:
        del entries[index]
    state_dict["state"] = entries
    return state_dict, (converted, writes, rests, OptimizerSnapshot(optimizer))


def loaded(optimizer, owner, pending):
    """After the optimizer's own load: the converted tensors in place, the masters written, the
    rows marked (on an error the optimizer's state before comes back)."""
    if pending is None:
        return
    converted, writes, rests, before = pending
    try:
        params = _params(optimizer)
        state = optimizer.state
        with torch.no_grad():
            for index, entry in converted.items():
                live = state[params[index]]
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        live[key] = value.to(params[index].device)
            for row, value in writes:
                owner.set_value(row, value)
            rests = [(row, rest.to(owner.params[row].device)) for row, rest in rests]
    except BaseException:  # what the checks could not foresee: the old state stays
        before.restore()
        raise
    for row, rest in rests:  # the owner's (after every step that can fail)
        owner.set_rest(row, rest)
    owner.mark()
    owner.refresh()
    amp_state.cast_cache.clear()


def _merge_older(entries, masters):
    """Older amp's top-level masters ({index: FP32 master or int8 correction}) into entries."""
    if not isinstance(masters, dict):
        raise TypeError(
            f"optimizer.load_state_dict: {MASTER_PARAMS_KEY!r} must map parameter indices "
            f"to tensors; got {type(masters).__name__}. Drop the key to keep the current master "
            "weights (they follow the model's weights)."
        )
    for index, value in masters.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"optimizer.load_state_dict: master weight {index} is a {type(value).__name__}, "
                "not a tensor."
            )
        key = MasterForm.KEYS["correction" if value.dtype is torch.int8 else FP32]
        entries[index] = dict(entries.get(index, {}), **{key: value})


def _rest_key(entry):
    if not isinstance(entry, dict):
        return None
    return next((key for key in _REST_KEYS if key in entry), None)


def _rest_dtype(key):
    return next(form.rest_dtype for form in _DECODERS.values() if form.key == key)


def _check_rest(value, param, index, key):
    """A clear error for a master's rest that cannot be this parameter's, before anything
    changes (copy_ would fail after torch's load replaced the state)."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        raise ValueError(
            f"optimizer.load_state_dict: the master weight ({key}) of parameter {index} has "
            f"shape {getattr(value, 'shape', type(value).__name__)}, expected "
            f"{tuple(param.shape)}."
        )
    if value.layout is not torch.strided or value.is_meta:
        kind = "a meta tensor (no data)" if value.is_meta else f"a {value.layout} tensor"
        raise ValueError(
            f"optimizer.load_state_dict: the master weight ({key}) of parameter {index} is "
            f"{kind}; masters load from dense tensors with data (as optimizer.state_dict() "
            "saves them)."
        )
    if not (value.is_floating_point() or value.dtype in (torch.int8, torch.int16, torch.int32)):
        raise ValueError(
            f"optimizer.load_state_dict: the master weight ({key}) of parameter {index} is "
            f"{value.dtype}: neither floating nor an int8 correction nor an int16 remainder "
            "(int32 in a sharded state dict)."
        )
    if key != MasterForm.KEYS[FP32] and param.dtype is not torch.bfloat16:
        raise ValueError(
            f"optimizer.load_state_dict: the master weight of parameter {index} is the {key} of "
            f"a bf16 weight, and this parameter is {param.dtype}. Load the model's FP32 state "
            "dict, and the optimizer's without its masters (they then follow the model)."
        )
