"""amp's fused master step at O2, for torch.optim's AdamW, Adam and SGD.

In place of the optimizer's own step (and the copy of the masters into the model after it), one
pass per chunk over each parameter group (amp.kernels.adam_step_ / sgd_step_): the gradient
unscaled, the FP32 master and the optimizer's own state tensors (`exp_avg`, `exp_avg_sq`,
`step`, `momentum_buffer`) updated in place, the low-precision weight written. The state keeps
torch's format, so `optimizer.state_dict()` loads into a plain torch optimizer. The step is
skipped on the device where the overflow flag is set: the host reads nothing.

With the CuPy kernels the gradients stay low precision until the step: scale_loss's exit only
checks them (the deferred gradients, masters.Deferred); on the torch backend the exit makes the
FP32 master gradients as the general path does and the step runs torch's fused op on them.

It applies where it computes what the optimizer's own step would (kernels.adam_step_ says to
which precision): the exact classes, no amsgrad, maximize, capturable or differentiable, float
hyperparameters, state made by an earlier step (the first step is the optimizer's own, which
makes it), dense gradients on one device, real (not complex) parameters. It runs the step's
pre- and post-hooks around itself, as torch's step does (its hyperparameters are read before the
pre-hooks run). Anything else takes the general path. `plan` says which, once per step, and `run`
carries a plan out. The hyperparameters are read from `param_groups` at every step (schedulers,
`add_param_group`); the user's `foreach` / `fused` flags choose an implementation of the same
update, so they take the fused step too. `AMP_FUSED_STEP=0` in the environment at
`amp.initialize` turns it off (every step the optimizer's own).
"""

import itertools
import operator
import os

import torch
from torch.optim import optimizer as torch_optimizer

from .. import kernels
from . import compact_state
from .columns import GRAD, IS_SPARSE, NONES

__all__ = ["FUSED_STEP_ENV", "check_covered", "FusedStep"]

FUSED_STEP_ENV = "AMP_FUSED_STEP"  # "0" at amp.initialize: every O2 step is the optimizer's own

_EXP_AVG, _EXP_AVG_SQ, _STEP = map(operator.itemgetter, ("exp_avg", "exp_avg_sq", "step"))
_BUFFER = operator.itemgetter("momentum_buffer")


_CLASSES = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


def _kind(optimizer, step):
    """ "adam" or "sgd" for an optimizer whose step is torch's own AdamW/Adam/SGD step, else
    None."""
    cls = type(optimizer)
    if cls is torch.optim.AdamW or cls is torch.optim.Adam:
        kind = "adam"
    elif cls is torch.optim.SGD:
        kind = "sgd"
    else:
        return None
    function = getattr(step, "__func__", None)
    if function is None and getattr(step, "_wrapped_by_lr_sched", False):
        function = getattr(step, "__wrapped__", None)  # an LR scheduler's wrapper keeps it
    # Another wrapper of the class's step (functools.wraps) does work of its own: it must run.
    return kind if function is cls.step else None


def _adam_options(group):
    beta1, beta2 = group["betas"]
    floats = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
    if not all(type(value) is float or type(value) is int for value in floats):
        return None  # tensors: the general path
    if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
        return None
    return dict(
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled=bool(group.get("decoupled_weight_decay", False)),
    )


def _sgd_options(group):
    floats = (group["lr"], group["momentum"], group["dampening"], group["weight_decay"])
    if not all(type(value) is float or type(value) is int for value in floats):
        return None
    if group["maximize"] or group["differentiable"]:
        return None
    return dict(
        lr=group["lr"],
        momentum=group["momentum"],
        dampening=group["dampening"],
        weight_decay=group["weight_decay"],
        nesterov=group["nesterov"],
    )


_OPTIONS = {"adam": _adam_options, "sgd": _sgd_options}
_STATELESS = object()  # FusedStep._call: a row's state is not made yet
NO_ROW = itertools.repeat(-1)  # dict.get's default for a parameter that is no master


def check_covered(optimizer, where, what):
    """Raise a ValueError naming what is not covered unless the fused step steps `optimizer`
    entirely (`what`: the option that needs it, which has no other step). Changes nothing."""
    kind = _kind(optimizer, optimizer.step)
    reason = None
    if os.environ.get(FUSED_STEP_ENV, "1") == "0":
        reason = f"{FUSED_STEP_ENV}=0 turns the fused step off"
    elif kind is None:
        reason = f"it is a {type(optimizer).__name__}" + (
            " whose step is wrapped" if type(optimizer) in _CLASSES else ""
        )
    else:
        for index, group in enumerate(optimizer.param_groups):
            if _OPTIONS[kind](group) is None:
                reason = (
                    f"param_groups[{index}] asks for what it does not compute (amsgrad, maximize, "
                    "capturable, differentiable, or a tensor hyperparameter)"
                )
                break
    if reason is not None:
        raise ValueError(
            f"amp.initialize: {what} is kept by amp's fused master step, which steps "
            "torch.optim.AdamW, Adam and SGD (without amsgrad, maximize, capturable or "
            f"differentiable, with float hyperparameters); {where}: {reason}. Use one of those, "
            "or master_weights=True with optimizer_state='fp32'."
        )


class FusedStep:
    """The fused master step of one optimizer (O2): `kind` is "adam", "sgd" or None (never)."""

    def __init__(self, optimizer, step, compact=False, state="fp32"):
        self.kind = _kind(optimizer, step)
        # The last plan found no state to step (the optimizer's own step makes it): the next
        # step may well be fused.
        self.stateless = False
        # How it keeps compact state (compact_state.py), or None: torch's FP32 format, made by
        # the optimizer's own first step
        self.form = None
        if self.kind is not None and (compact or state != "fp32"):
            self.form = compact_state.Form(self.kind, compact, state)
            self.what = "master_weights='compact'" if compact else f"optimizer_state={state!r}"

    @classmethod
    def made_for(cls, optimizer, step, compact=False, state="fp32"):
        """The fused master step for an optimizer with masters whose step is `step`, or None
        (not torch's AdamW, Adam or SGD step, or AMP_FUSED_STEP=0; check_covered refuses those
        for compact state at initialize)."""
        if os.environ.get(FUSED_STEP_ENV, "1") == "0":
            return None
        fused = cls(optimizer, step, compact, state)
        return fused if fused.kind is not None else None

    def plan(self, optimizer, table, deferred):
        """The kernel calls of this step, or None where the fused step does not apply now (the
        general path). `table`: the optimizer's (which parameters are masters, of which model
        parameters); `deferred` (a deferral.Deferred or None): the masters' gradients kept in
        low precision, else their `.grad` are read. Constant Python calls per group."""
        self.stateless = False
        options_of = _OPTIONS[self.kind]
        if self.form is not None:  # compact state: no other step, made here at the first
            return compact_state.plan(self.form, optimizer, table, deferred, options_of, self.what)
        state = optimizer.state
        rows_of, low = table.master_index, [*table.models, None]  # low[-1]: no master row
        calls = []
        for group in optimizer.param_groups:
            options = options_of(group)
            if options is None:
                return None
            params = group["params"]
            models = list(map(low.__getitem__, map(rows_of.get, map(id, params), NO_ROW)))
            # A group of masters and plain parameters (batch norm's, kept FP32) is one call.
            if not any(map(operator.is_not, models, NONES)):
                rows = ((params, None, list(map(GRAD, params)), None),)
            elif deferred is not None:
                rows = _deferred_rows(params, models, deferred)
            else:
                rows = ((params, models, list(map(GRAD, params)), None),)
            for row in rows:
                call = self._call(state, options, *row)
                if call is None:
                    continue
                if call is False or call is _STATELESS:
                    self.stateless = call is _STATELESS
                    return None
                calls.append(call)
        return calls

    def run(self, optimizer, calls, found_inf):
        """Carry out a plan as the optimizer's own step runs (torch.optim.Optimizer's
        profile_hook_step): between its step pre- and post-hooks, global and its own, in its
        profiler range while a profiler records; skipped on the device where `found_inf` is set
        (the hooks run: torch's fused optimizers are stepped with the flag too)."""
        pre = torch_optimizer._global_optimizer_pre_hooks or optimizer._optimizer_step_pre_hooks
        post = torch_optimizer._global_optimizer_post_hooks or optimizer._optimizer_step_post_hooks
        if not (pre or post or torch.autograd._profiler_enabled()):
            self._launch(calls, found_inf)  # the usual step: nothing to call around it
            optimizer._optimizer_step_code()
            return
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
                        f"A step pre-hook of {type(optimizer).__name__} returned {result!r}: new "
                        "arguments for step(), which amp's fused step at O2 takes none of (no "
                        "closure). Return None from the hook, or run with AMP_FUSED_STEP=0."
                    )
            self._launch(calls, found_inf)
            optimizer._optimizer_step_code()
            for hook in itertools.chain(
                optimizer._optimizer_step_post_hooks.values(),
                torch_optimizer._global_optimizer_post_hooks.values(),
            ):
                hook(optimizer, args, kwargs)

    def _launch(self, calls, found_inf):
        # torch.no_grad() inlined: its context manager's calls would run at every step.
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self.form is not None:
                compact_state.launch(self.form, calls, found_inf)
                return
            for options, grads, params, models, tensors, inv_scale, states in calls:
                if states is not None:  # torch's CPU step counts: moved once (_state)
                    tensors = (*tensors[:2], _steps_on(params, states))
                if self.kind == "adam":
                    kernels.adam_step_(
                        grads, models, params, *tensors, kernels.AdamOptions(**options),
                        inv_scale=inv_scale, found_inf=found_inf,
                    )
                else:
                    kernels.sgd_step_(
                        grads, models, params, *tensors, kernels.SGDOptions(**options),
                        inv_scale=inv_scale, found_inf=found_inf,
                    )
        finally:
            torch._C._set_grad_enabled(grad_enabled)

    def _call(self, state, options, params, models, grads, inv_scale):
        """The arguments of one kernel call for these rows; None if none has a gradient, False
        if the fused step cannot take them (the general path), _STATELESS if some state is not
        there yet."""
        if not all(map(operator.is_not, grads, NONES)):  # parameters without a gradient
            present = list(map(operator.is_not, grads, NONES))
            if not any(present):
                return None
            grads = list(itertools.compress(grads, present))
            params = list(itertools.compress(params, present))
            models = None if models is None else list(itertools.compress(models, present))
        if any(map(IS_SPARSE, grads)) or any(map(torch.is_complex, params)):
            return False  # torch's fused ops and the kernels take neither: the general path
        found = self._state(state, params, options)
        if found is None:
            return _STATELESS
        tensors, moved = found
        return options, grads, params, models, tensors, inv_scale, moved

    def _state(self, state, params, options):
        """(the state lists of `params` for the kernel, their state dicts where the step counts
        must move to the device first, else None), or None if a step has not made them yet."""
        if self.kind == "sgd" and options["momentum"] == 0:
            return ([],), None  # no state to keep
        states = list(map(state.get, params))
        try:
            if self.kind == "adam":
                steps = list(map(_STEP, states))
                tensors = list(map(_EXP_AVG, states)), list(map(_EXP_AVG_SQ, states)), steps
                # torch's non-capturable foreach and for-loop paths keep step counts on the host
                moved = states if steps and steps[0].device != params[0].device else None
                return tensors, moved
            buffers = list(map(_BUFFER, states))
        except (KeyError, TypeError):  # no state yet (None), or one without the key
            return None
        if not all(map(operator.is_not, buffers, NONES)):
            return None
        return (buffers,), None


def _deferred_rows(params, models, deferred):
    """[(params, models, gradients, inv_scale)] of a group whose masters' gradients are kept low
    precision and still scaled: the masters' rows, and the plain parameters' apart."""
    if all(map(operator.is_not, models, NONES)):
        return ((params, models, deferred.grads_of(params), deferred.inv_scale),)
    present = list(map(operator.is_not, models, NONES))
    masters = list(itertools.compress(params, present))
    master_models = list(itertools.compress(models, present))
    plain = [param for param, model in zip(params, models) if model is None]
    return (
        (masters, master_models, deferred.grads_of(masters), deferred.inv_scale),
        (plain, None, list(map(GRAD, plain)), None),
    )


def _steps_on(params, states):
    """Move step counts kept on the host to the parameters' device, once: the kernel counts
    them there."""
    for param, state in zip(params, states):
        state["step"] = state["step"].to(param.device)
    return list(map(_STEP, states))
