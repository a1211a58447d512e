"""O2's compact state: what the fused step keeps for each parameter when the masters are compact
(`master_weights="compact"`: the bf16 weight and an int8 correction, table.py) or the moments are
(`optimizer_state="bf16"` or `"int8"`), and the conversions to and from torch's FP32 format.

The moments sit in the optimizer's state under their own keys, so a plain torch optimizer never
takes them for its own (it would find no `exp_avg` and say so): `<moment>_bf16` (a bf16 tensor),
or `<moment>_codes` and `<moment>_scales` (kernels.moment_encode's). With `"fp32"` they are
torch's own keys. The step count is torch's `step`. The fused step makes the state at a
parameter's first step (there is no other step to make it); `to_torch` and `from_torch` convert
an entry, for a checkpoint of the other kind and for deinitialize.
"""

import itertools
import operator

import torch

from .. import kernels

__all__ = ["MOMENTS", "Form", "to_torch", "from_torch", "plan", "launch"]

# The moments of each kind of step, and whether each is signed (kernels.moment_encode's `signed`)
MOMENTS = {"adam": (("exp_avg", True), ("exp_avg_sq", False)), "sgd": (("momentum_buffer", True),)}


class Form:
    """How one optimizer's fused step keeps its state: `kind` ("adam" or "sgd"), `compact`
    masters or FP32 ones, and `state` ("fp32", "bf16" or "int8") for the moments."""

    def __init__(self, kind, compact, state):
        self.kind, self.compact, self.state = kind, compact, state
        self.moments = MOMENTS[kind]

    def keys(self, moment):
        """The state keys a moment is held under."""
        if self.state == "fp32":
            return (moment,)
        if self.state == "bf16":
            return (f"{moment}_bf16",)
        return (f"{moment}_codes", f"{moment}_scales")

    def tensors(self, states, momentum):
        """(moments, scales or None, steps) of the parameters whose state dicts are `states`: a
        list per moment (None without momentum), their scales for 8-bit codes."""
        moments, scales = [], []
        for moment, _ in self.moments:
            if moment == "momentum_buffer" and not momentum:
                moments.append(None)
                continue
            keys = self.keys(moment)
            moments.append(list(map(operator.itemgetter(keys[0]), states)))
            if len(keys) == 2:
                scales.append(list(map(operator.itemgetter(keys[1]), states)))
        steps = list(map(operator.itemgetter("step"), states)) if self.kind == "adam" else None
        return moments, (scales if scales else None), steps

    def made(self, param, state, momentum):
        """Make `param`'s state (empty or missing the moments) as a first step finds it: zero
        moments, step 0. Returns whether it was made (SGD's first step starts the momentum as
        the gradient)."""
        made = False
        if self.kind == "adam" and "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            made = True
        for moment, _ in self.moments:
            if moment == "momentum_buffer" and not momentum:
                continue
            keys = self.keys(moment)
            if keys[0] in state:
                continue
            state.update(self._encoded(moment, torch.zeros(param.shape, device=param.device)))
            made = True
        return made

    def _encoded(self, moment, values, signed=None):
        if signed is None:
            signed = dict(self.moments)[moment]
        keys = self.keys(moment)
        if self.state == "fp32":
            return {keys[0]: values.float().contiguous()}
        if self.state == "bf16":
            return {keys[0]: values.to(torch.bfloat16).contiguous()}
        codes, scales = kernels.moment_encode(values.float(), signed)
        return {keys[0]: codes.contiguous(), keys[1]: scales}

    def dtypes_restored(self, state):
        """`state` (an entry torch's load_state_dict cast: it casts every state tensor to its
        parameter's dtype, 8-bit codes and bf16 moments too) with this form's dtypes again."""
        for moment, signed in self.moments:
            key = self.keys(moment)[0]
            value = state.get(key)
            if self.state == "bf16" and value is not None:
                state[key] = value.to(torch.bfloat16)
            elif self.state == "int8" and value is not None:
                state[key] = value.to(torch.int8 if signed else torch.uint8)
        return state

    def from_torch(self, state):
        """A state entry in torch's FP32 format (or this form's already) in this form."""
        return from_torch(self, state)

    def to_torch(self, state):
        """A state entry of this form in torch's FP32 format."""
        return to_torch(self, state)


def to_torch(form, state):
    """`state` (a parameter's entry in `form`) with its moments as torch's FP32 tensors."""
    out = {key: value for key, value in state.items() if not _is_moment_key(form, key)}
    for moment, _ in form.moments:
        keys = form.keys(moment)
        if keys[0] not in state:
            continue
        if form.state == "fp32":
            out[moment] = state[moment]
        elif form.state == "bf16":
            out[moment] = state[keys[0]].float()
        else:
            out[moment] = kernels.moment_decode(state[keys[0]], state[keys[1]])
    return out


def from_torch(form, state):
    """`state` in `form`: moments found under torch's FP32 keys (or any form's keys) encoded
    as `form` keeps them; other entries kept."""
    out = {key: value for key, value in state.items() if _moment_of(form, key) is None}
    for moment, signed in form.moments:
        keys = form.keys(moment)
        if all(key in state for key in keys):  # already so: kept as it is (no new rounding)
            out.update({key: state[key] for key in keys})
            continue
        values = _values(form, state, moment)
        if values is not None:
            out.update(form._encoded(moment, values, signed))
    return out


def _values(form, state, moment):
    """The FP32 values of `moment` in `state`, whichever way it is held there (None if not)."""
    if moment in state and isinstance(state[moment], torch.Tensor):
        return state[moment].float()
    if f"{moment}_bf16" in state:
        return state[f"{moment}_bf16"].float()
    if f"{moment}_codes" in state and f"{moment}_scales" in state:
        return kernels.moment_decode(state[f"{moment}_codes"], state[f"{moment}_scales"].float())
    return None


def _moment_of(form, key):
    for moment, _ in form.moments:
        if key in (moment, f"{moment}_bf16", f"{moment}_codes", f"{moment}_scales"):
            return moment
    return None


def _is_moment_key(form, key):
    return _moment_of(form, key) is not None


# -- the fused step over compact state ---------------------------------------------------------

_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_NO_ROW = itertools.repeat(-1)  # dict.get's default for a parameter that is no master


def plan(form, optimizer, table, deferred, options_of, what):
    """The kernel calls of one step over compact state (dicts of launch's arguments), every
    parameter with a gradient, its state made at its first step. Raises where the step cannot
    take a group (compact state has no other step; `what` names the option that keeps it)."""
    state_of = optimizer.state
    index = table.master_index
    calls = []
    for group_index, group in enumerate(optimizer.param_groups):
        options = options_of(group)
        if options is None:
            raise RuntimeError(
                f"optimizer.step(): param_groups[{group_index}] asks for what amp's fused step "
                "does not compute (a tensor hyperparameter, amsgrad, maximize, capturable or "
                f"differentiable), and {what} has no other step. Keep the hyperparameters "
                "floats (an LR scheduler's too) and those options off."
            )
        momentum = form.kind == "adam" or options["momentum"] != 0
        params = group["params"]
        rows = list(map(index.get, map(id, params), _NO_ROW))
        for of_masters in (True, False):  # the master rows, then the plain ones (batch norm's)
            picked = [i for i, row in enumerate(rows) if (row >= 0) is of_masters]
            if not picked:
                continue
            chosen = [params[i] for i in picked]
            if of_masters and deferred is not None:
                grads, inv_scale = deferred.grads_of(chosen), deferred.inv_scale
            else:
                grads, inv_scale = list(map(_GRAD, chosen)), None
            rows_chosen = [rows[i] for i in picked] if of_masters else None
            call = _call(form, state_of, options, momentum, chosen, rows_chosen, grads, table)
            if call is not None:
                call["inv_scale"] = inv_scale
                calls.extend(_first_steps_apart(form, call, momentum))
    return calls


def _call(form, state_of, options, momentum, params, rows, grads, table):
    """One call's arguments for `params` (their master `rows`, or None for plain parameters),
    those without a gradient left out; None if none has one."""
    if not all(map(operator.is_not, grads, itertools.repeat(None))):
        keep = list(map(operator.is_not, grads, itertools.repeat(None)))
        params = list(itertools.compress(params, keep))
        grads = list(itertools.compress(grads, keep))
        rows = None if rows is None else list(itertools.compress(rows, keep))
    if not params:
        return None
    if any(map(_IS_SPARSE, grads)) or any(map(torch.is_complex, params)):
        raise RuntimeError(
            "optimizer.step(): a sparse gradient or a complex parameter, which amp's fused step "
            "does not take, and compact state has no other step."
        )
    states = list(map(state_of.get, params))
    first = None
    if None in states or not all(_has(form, state, momentum) for state in states):
        states = [state_of[param] for param in params]  # torch's state is a defaultdict
        first = [form.made(param, state, momentum) for param, state in zip(params, states)]
    moments, scales, steps = form.tensors(states, momentum)
    if rows is None:  # plain parameters: their own FP32 values are stepped
        masters, lows, corrections = params, [None] * len(params), None
    else:
        lows = [table.models[row] for row in rows]
        if form.compact:
            masters, corrections = None, [table.corrections[row] for row in rows]
        else:
            masters, corrections = params, None
    return dict(
        options=options,
        grads=grads,
        masters=masters,
        lows=lows,
        corrections=corrections,
        moments=moments,
        scales=scales,
        steps=steps,
        first=first,
    )


def _has(form, state, momentum):
    return (form.kind != "adam" or "step" in state) and all(
        form.keys(moment)[0] in state
        for moment, _ in form.moments
        if momentum or moment != "momentum_buffer"
    )


def _first_steps_apart(form, call, momentum):
    """SGD's momentum starts as the gradient at a parameter's first step: those rows apart."""
    first = call.pop("first")
    if form.kind != "sgd" or not momentum or first is None or not any(first):
        return [dict(call, first_step=False)]
    parts = []
    for wanted in (True, False):
        indices = [i for i, is_first in enumerate(first) if is_first is wanted]
        if indices:
            parts.append(dict(_pick(call, indices), first_step=wanted))
    return parts


def _pick(call, indices):
    def pick(values):
        return None if values is None else [values[i] for i in indices]

    return dict(
        call,
        grads=pick(call["grads"]),
        masters=pick(call["masters"]),
        lows=pick(call["lows"]),
        corrections=pick(call["corrections"]),
        moments=[pick(moment) for moment in call["moments"]],
        scales=None if call["scales"] is None else [pick(s) for s in call["scales"]],
    )


def launch(form, calls, found_inf):
    """Carry out plan's calls (skipped on the device where `found_inf` is set)."""
    for call in calls:
        scales = call["scales"]
        masters = call["corrections"] if call["masters"] is None else call["masters"]
        common = dict(inv_scale=call["inv_scale"], found_inf=found_inf)
        if form.kind == "adam":
            kernels.adam_step_(
                call["grads"],
                call["lows"],
                masters,
                call["moments"][0],
                call["moments"][1],
                call["steps"],
                kernels.AdamOptions(**call["options"]),
                scales=None if scales is None else tuple(scales),
                **common,
            )
        else:
            kernels.sgd_step_(
                call["grads"],
                call["lows"],
                masters,
                call["moments"][0] or [],
                kernels.SGDOptions(**call["options"]),
                scales=None if scales is None else scales[0],
                first_step=call["first_step"],
                **common,
            )
