"""amp's fused step at O2, for torch.optim's AdamW, Adam and SGD: which groups it steps, the
options of each group (one kernels.AdamOptions / SGDOptions per group and step, read by every
backend and every form of the state), and the step of an optimizer's owner (owner.py), run as
torch runs the optimizer's own.

It steps what the optimizer's own step would (kernels.adam_step_ says to which precision): the
exact classes with their own step (paths.kind_of), without amsgrad, maximize, capturable or
differentiable, with real-number hyperparameters (a NumPy float is one, as for torch). The
user's `foreach` / `fused` flags choose an implementation of the same update, so they are
stepped too.

A step reads each parameter's state entry where forms.Layout says, makes the state of the
parameters stepped for the first time (zero moments, step 0: what torch's first step finds) only
once the step is known to be taken, and changes nothing where it refuses a group: every group is
planned before anything changes. A step skipped on the device changes no bit. It runs at a
constant number of Python calls however many parameters there are: the settled step's reads are
C-level (`map`) over whole lists.
"""

import itertools
import numbers
import operator

import torch
from torch.optim import optimizer as torch_optimizer

from .. import kernels
from ..distributed import shard_start, shards
from .forms import FP32
from .columns import GRAD, IS_SPARSE, MARKS, NONES, VERSION, consume, repeat

__all__ = ["uncovered", "options_of", "step"]

_FLOATS = frozenset((float, int))
_FLAGS = {"adam": ("amsgrad", "maximize", "capturable", "differentiable"),
          "sgd": ("maximize", "differentiable")}
_NUMBERS = {"adam": ("lr", "eps", "weight_decay"), "sgd": ("lr", "momentum", "dampening",
                                                           "weight_decay")}
_NOT_NONE = operator.is_not
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_CONTAINS = operator.contains
_NUMEL = operator.methodcaller("numel")


# -- a group's options -------------------------------------------------------------------------


def _number(value):
    """`value` as a float where torch takes it as a number (a float, an int, a NumPy float), else
    None (a tensor, a bool)."""
    kind = type(value)
    if kind is float or kind is int:
        return float(value)
    if kind is bool or isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def uncovered(kind, group):
    """Why the fused step cannot step `group` (its options), or None."""
    flags = list(filter(group.get, _FLAGS[kind]))
    if flags:
        return f"it asks for {' and '.join(flags)}"
    names = _NUMBERS[kind] + (("betas",) if kind == "adam" else ())
    values = [group[name] for name in _NUMBERS[kind]]
    if kind == "adam":
        values += list(group["betas"])
    for name, value in zip(names, values):
        if _number(value) is None:
            return f"its {name} is a {type(value).__name__}, not a number"
    return None


def options_of(kind, group):
    """The group's options for the kernels (None where `uncovered`)."""
    if kind == "adam":
        beta1, beta2 = group["betas"]
        values = [group["lr"], beta1, beta2, group["eps"], group["weight_decay"]]
        flags = group["amsgrad"] or group["maximize"] or group["capturable"]
    else:
        values = [group["lr"], group["momentum"], group["dampening"], group["weight_decay"]]
        flags = group["maximize"]
    if flags or group["differentiable"]:
        return None
    if not set(map(type, values)) <= _FLOATS:  # a NumPy float is a number; a tensor is not
        values = list(map(_number, values))
        if None in values:
            return None
    if kind == "adam":
        return kernels.AdamOptions(*map(float, values), group.get("decoupled_weight_decay", False))
    return kernels.SGDOptions(*map(float, values), group["nesterov"])


# -- the step -----------------------------------------------------------------------------------


def step(owner, found_inf, learn, zero):
    """One step of `owner` (owner.StateOwner) between the optimizer's step hooks, global and its
    own, in its profiler range while a profiler records (torch.optim.Optimizer's
    profile_hook_step). Skipped on the device where `found_inf` is set. `learn()` waits for the
    step's checks and says whether it is skipped: asked only where state must be made. Returns
    whether it stepped; then the gradients it read go (`zero`: zeroed, they stay)."""
    optimizer = owner.optimizer
    pre = torch_optimizer._global_optimizer_pre_hooks or optimizer._optimizer_step_pre_hooks
    post = torch_optimizer._global_optimizer_post_hooks or optimizer._optimizer_step_post_hooks
    if not (pre or post or torch.autograd._profiler_enabled()):  # the usual step
        stepped = _step(owner, found_inf, learn)
        optimizer._optimizer_step_code()
    else:
        with torch.autograd.profiler.record_function(
            f"Optimizer.step#{type(optimizer).__name__}.step"
        ):
            args, kwargs = (optimizer,), {}
            for hook in itertools.chain(
                torch_optimizer._global_optimizer_pre_hooks.values(),
                optimizer._optimizer_step_pre_hooks.values(),
            ):
                result = hook(optimizer, args, kwargs)
                if result is not None and result != ((optimizer,), {}):
                    raise RuntimeError(
                        f"A step pre-hook of {type(optimizer).__name__} returned {result!r}: "
                        "new arguments for step(), which amp's fused step at O2 takes none of "
                        "(no closure). Return None from the hook, or run with AMP_FUSED_STEP=0."
                    )
            stepped = _step(owner, found_inf, learn)
            optimizer._optimizer_step_code()
            for hook in itertools.chain(
                optimizer._optimizer_step_post_hooks.values(),
                torch_optimizer._global_optimizer_post_hooks.values(),
            ):
                hook(optimizer, args, kwargs)
    if stepped:
        # What the owner holds apart from the model's `.grad` (its sources) goes with them.
        if zero or owner.kept is not None or owner.grads or owner.handed or owner.copies:
            owner.drop_grads(zero)
        else:  # the usual case: the gradients read were the model's (owner.drop_grads's)
            consume(map(setattr, owner.params, repeat("grad"), NONES))
    return stepped


def _step(owner, found_inf, learn):
    params = owner.params
    # What reached the rows around amp is taken first (Rows.unchanged, inlined: every step).
    if (
        owner.lent.keys
        or [list(map(read, params)) for read in MARKS] != owner.marks
        or (owner.fp32 and list(map(VERSION, owner.rests_seen)) != owner.rest_versions)
    ):
        owner.take_writes()
    calls, first = _plan(owner)
    if first and found_inf is not None and learn():
        return False  # skipped: no state is made
    made = set()
    state, form = owner.optimizer.state, owner.state_form
    for param, momentum, in_form in first:
        if form.start(param, state[param], momentum, in_form):
            made.add(id(param))
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    rests = [None] * len(params) if owner.fp32 else None
    try:
        for call in calls:
            _launch(owner, call, made, found_inf, rests)
    finally:
        torch._C._set_grad_enabled(grad_enabled)
    if rests is not None and None in rests:  # rows no call stepped
        rests = None
    owner.written_by_amp(rests)
    return True


def _plan(owner):
    """(the kernel calls of this step, [(param, momentum, in_form)] whose state a first step
    makes); raises, changing nothing, for a group the fused step cannot step. A group's rows
    with FP32 gradients and its plain parameters are one call (the kernels split what their
    forms need apart); its kept gradients, scaled, another."""
    optimizer, kind, form = owner.optimizer, owner.kind, owner.state_form
    index_get = owner.index.get
    kept = owner.kept
    # the rows' gradients; the usual case: a bf16 model's in its `.grad`, read below
    fp32 = owner.sources() if owner.grads or owner.handed or owner.copies else None
    calls, first = [], []
    state_get = optimizer.state.get
    for number, group in enumerate(optimizer.param_groups):
        options = options_of(kind, group)
        if options is None:
            raise RuntimeError(
                f"optimizer.step(): param_groups[{number}] {uncovered(kind, group)}, which "
                "amp's fused step at O2 does not compute, and it steps this "
                f"{type(optimizer).__name__}'s parameters (their masters, moments and step "
                "counts are in its state). Nothing was changed. Keep the hyperparameters "
                "numbers (an LR scheduler's too) and those options off, or pass the optimizer "
                "to amp.initialize with them set (every step is then its own, on FP32 masters)."
            )
        momentum = kind == "adam" or options.momentum != 0
        params = group["params"]
        rows = list(map(index_get, map(id, params)))
        if kept is not None:
            scaled_of = dict(zip(kept.rows, kept.grads))
            _add_call(owner, calls, number, options, momentum, kept.inv_scale, params, rows,
                      list(map(scaled_of.get, rows)))
        if fp32 is None:  # every gradient where the parameters hold it
            grads = list(map(GRAD, params))
        elif None not in rows:  # only rows
            grads = list(map(fp32.__getitem__, rows))
        else:  # a plain parameter's own gradient
            grads = [p.grad if r is None else fp32[r] for p, r in zip(params, rows)]
        _add_call(owner, calls, number, options, momentum, None, params, rows, grads)
    for call in calls:
        call.states = states = list(map(state_get, call.params))
        layout = form.layouts[call.momentum, call.in_form]
        needed, sized = layout.needed, layout.sized
        if None in states or any(False in map(_CONTAINS, states, repeat(k)) for k in needed):
            for param, entry in zip(call.params, states):
                if entry is None or not all(key in entry for key in needed):
                    first.append((param, call.momentum, call.in_form))
                for key, value in () if entry is None else entry.items():  # any form's
                    if key != "step" and not key.endswith("_scales") and torch.is_tensor(value):
                        _check_shape(optimizer, param, value, key)
        elif sized is not None and list(map(_SHAPE, map(operator.itemgetter(sized), states))) != (
            list(map(_SHAPE, call.params))
        ):
            for param, entry in zip(call.params, states):
                _check_shape(optimizer, param, entry[sized], sized)
    return calls, first


def _check_shape(optimizer, param, moment, key):
    """Refuse, changing nothing, a parameter whose state was made for another shape: new data
    of another shape (`param.data = ...`), which torch's own step refuses too."""
    if moment.shape != param.shape:
        number, index = next(
            (n, i)
            for n, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
            if p is param
        )
        raise RuntimeError(
            f"optimizer.step(): param_groups[{number}]['params'][{index}] has shape "
            f"{tuple(param.shape)}, and its optimizer state ({key}: {tuple(moment.shape)}) was "
            "made for another shape: new data of another shape in the parameter (param.data = "
            "...) leaves state that does not fit it. Nothing was changed. Drop its state "
            "(del optimizer.state[param]) to start it afresh, or load a checkpoint made for the "
            "new shape."
        )


def _add_call(owner, calls, number, options, momentum, inv_scale, params, rows, grads):
    """The call of a group's parameters whose gradients in `grads` are there (none: none)."""
    present = list(map(_NOT_NONE, grads, NONES))
    if not all(present):
        if not any(present):
            return
        params = list(itertools.compress(params, present))
        rows = list(itertools.compress(rows, present))
        grads = list(itertools.compress(grads, present))
    call = _Call(options, momentum, inv_scale, params, grads, rows)
    _check_grads(owner, call, number)
    calls.extend(call.split_by_form(owner.state_form))


def _check_grads(owner, call, number):
    if any(map(IS_SPARSE, call.grads)) and owner.kind == "adam":
        raise RuntimeError(
            f"optimizer.step(): param_groups[{number}] has a sparse gradient, which "
            f"{type(owner.optimizer).__name__} does not support (torch's raises too); use "
            "torch.optim.SparseAdam for sparse embeddings. Nothing was changed."
        )
    if list(map(_SHAPE, call.grads)) == list(map(_SHAPE, call.params)):
        return
    for param, grad in zip(call.params, call.grads):
        if grad.shape != param.shape:
            raise RuntimeError(
                f"optimizer.step(): a gradient of shape {tuple(grad.shape)} for a parameter "
                f"of shape {tuple(param.shape)} (param_groups[{number}]). Nothing was changed."
            )


def _launch(owner, call, made, found_inf, fp32_rests=None):
    params, rows, states = call.params, call.rows, call.states
    if made:  # the entries a first step made
        state = owner.optimizer.state
        states = [state[p] if s is None else s for p, s in zip(params, states)]
    layout = owner.state_form.layouts[call.momentum, call.in_form]
    if len(layout.keys) == 1:
        columns = [list(map(layout.read, states))]
    else:
        columns = list(map(list, zip(*map(layout.read, states)))) if layout.keys else []
    moments = [None if i is None else columns[i] for i in layout.moments]
    scales = [columns[i] for i in layout.scales] or None
    steps = None if layout.steps is None else columns[layout.steps]
    grads = [g.to_dense() if g.is_sparse else g for g in call.grads]  # SGD's, as torch adds
    rests = owner.rest_list
    if all(map(_NOT_NONE, rows, NONES)):
        lows, masters = params, list(map(rests.__getitem__, rows))
    else:  # a plain parameter is its own FP32 master, without a copy
        lows = [p if r is not None else None for p, r in zip(params, rows)]
        masters = [rests[r] if r is not None else p for p, r in zip(params, rows)]
        if any(map(torch.is_complex, params)):  # stepped as torch does: their real views
            masters = list(map(_real, masters))
            grads = list(map(_real, grads))
            moments = [None if m is None else list(map(_real, m)) for m in moments]
    if fp32_rests is not None:  # the FP32 masters, for the marks
        for row, master in zip(rows, masters):
            if row is not None:
                fp32_rests[row] = master
    starts = None
    if owner.sharded:  # FSDP2's DTensors: each rank steps its local shards
        grads, lows, masters = shards(grads), shards(lows), shards(masters)
        moments = [None if m is None else shards(m) for m in moments]
        scales = None if scales is None else list(map(shards, scales))
        if owner.state_form.moments != "fp32":  # rounded by the elements' places in the whole
            # (None: split along another dim, which shards.check allows FP32 moments only)
            starts = [start or 0 for start in map(shard_start, params)]
    if scales is not None:  # an 8-bit moment's scales are laid out as its rows: read flat
        scales = [list(map(_FLAT, column)) for column in scales]
    if owner.kind == "adam":
        kernels.adam_step_(
            grads, lows, masters, moments[0], moments[1], _on_device(steps, states, params),
            call.options, scales=None if scales is None else tuple(scales),
            inv_scale=call.inv_scale, found_inf=found_inf, starts=starts,
        )
        return
    if not (made and call.momentum):  # no buffer starts: one call
        kernels.sgd_step_(
            grads, lows, masters, moments[0] if call.momentum else [], call.options,
            scales=None if scales is None else scales[0], inv_scale=call.inv_scale,
            found_inf=found_inf,
        )
        return
    starting = list(map(made.__contains__, map(id, params)))
    for first_step in (True, False):
        picked = [i for i, s in enumerate(starting) if s is first_step]
        if not picked:
            continue
        kernels.sgd_step_(
            _pick(grads, picked), _pick(lows, picked), _pick(masters, picked),
            _pick(moments[0], picked) if call.momentum else [], call.options,
            scales=None if scales is None else _pick(scales[0], picked),
            first_step=first_step, inv_scale=call.inv_scale, found_inf=found_inf,
        )


class _Call:
    """One kernel call's parameters, gradients and rows (None: a plain parameter), of one group,
    one scale and one kind of moments."""

    __slots__ = ("options", "momentum", "inv_scale", "params", "grads", "rows", "in_form", "states")

    def __init__(self, options, momentum, inv_scale, params, grads, rows, in_form=True):
        self.options, self.momentum, self.inv_scale = options, momentum, inv_scale
        self.params, self.grads, self.rows, self.in_form = params, grads, rows, in_form
        self.states = None  # their state entries (None: none yet), found by the plan

    def split_by_form(self, form):
        """This call, or its parameters apart by how their moments are held (forms.StateForm's
        in_form: the form, FP32 under "int8", or torch's format)."""
        cast = map(_NOT_NONE, self.rows, NONES)
        if form.moments == "int8":  # a parameter without codes: FP32
            params = self.params
            keys = list(zip(map(_SHAPE, params), map(_DTYPE, params), cast))
            in_form = list(map(form.in_forms.get, keys))
            if None in in_form:  # a shape, dtype or cast not seen yet: forms decides, once
                for i, key in enumerate(keys):
                    if in_form[i] is None:
                        in_form[i] = form.in_forms[key] = form.in_form(params[i], key[2])
        else:  # in_form inlined (every step)
            fp32 = map(operator.is_, map(_DTYPE, self.params), repeat(torch.float32))
            in_form = list(map(operator.or_, cast, fp32))
        if in_form.count(True) == len(in_form):
            return [self]
        parts = []
        for wanted in (True, FP32, False):
            picked = [i for i, f in enumerate(in_form) if f == wanted]
            if picked:
                parts.append(_Call(
                    self.options, self.momentum, self.inv_scale, _pick(self.params, picked),
                    _pick(self.grads, picked), _pick(self.rows, picked), wanted,
                ))
        return parts


def _pick(values, indices):
    return None if values is None else [values[i] for i in indices]


_FLAT = operator.methodcaller("view", -1)


def _real(tensor):
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _on_device(steps, states, params):
    """Step counts kept on the host (torch's non-capturable foreach and for-loop steps keep them
    there) moved to their parameters' device, once: the kernels count them there."""
    if not steps or steps[0].device == params[0].device:
        return steps
    for param, state in zip(params, states):
        state["step"] = state["step"].to(param.device)
    return [state["step"] for state in states]
