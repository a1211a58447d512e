"""amp's fused step at O2, for torch.optim's AdamW, Adam and SGD: which optimizers and groups it
steps, the options of each group (one kernels.AdamOptions / SGDOptions per group and step, read by
every backend and every form of the state), and a step run as torch runs the optimizer's own.

It steps what the optimizer's own step would (kernels.adam_step_ says to which precision): the
exact classes with their own step (an LR scheduler's wrapper aside), without amsgrad, maximize,
capturable or differentiable, with real-number hyperparameters (a NumPy float is one, as for
torch). The user's `foreach` / `fused` flags choose an implementation of the same update, so they
are stepped too. `AMP_FUSED_STEP=0` in the environment at `amp.initialize` turns it off: every
optimizer is then stepped by its own step, on FP32 masters (copies.py).
"""

import itertools
import numbers
import os

import torch
from torch.optim import optimizer as torch_optimizer

from .. import kernels

__all__ = ["FUSED_STEP_ENV", "kind_of", "why_not", "uncovered", "options_of", "run"]

FUSED_STEP_ENV = "AMP_FUSED_STEP"  # "0" at amp.initialize: every O2 step is the optimizer's own

_KINDS = {torch.optim.AdamW: "adam", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
_FLOATS = frozenset((float, int))
_FLAGS = {"adam": ("amsgrad", "maximize", "capturable", "differentiable"),
          "sgd": ("maximize", "differentiable")}
_NUMBERS = {"adam": ("lr", "eps", "weight_decay"), "sgd": ("lr", "momentum", "dampening",
                                                           "weight_decay")}


def kind_of(optimizer):
    """ "adam" or "sgd" where amp's fused step can step `optimizer` (torch's AdamW, Adam or SGD,
    its step the class's own), else None."""
    if os.environ.get(FUSED_STEP_ENV, "1") == "0":
        return None
    cls = type(optimizer)
    kind = _KINDS.get(cls)
    if kind is None:
        return None
    step = optimizer.step
    function = getattr(step, "__func__", None)
    if function is None and getattr(step, "_wrapped_by_lr_sched", False):
        function = getattr(step, "__wrapped__", None)  # an LR scheduler's wrapper keeps it
    # Another wrapper of the class's step (functools.wraps) does work of its own: it must run.
    return kind if function is cls.step else None


def why_not(optimizer):
    """Why the fused step cannot step `optimizer` at all, or None."""
    if os.environ.get(FUSED_STEP_ENV, "1") == "0":
        return f"{FUSED_STEP_ENV}=0 turns the fused step off"
    if kind_of(optimizer) is None:
        cls = type(optimizer)
        return f"it is a {cls.__name__}" + (" whose step is wrapped" if cls in _KINDS else "")
    return None


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


def run(optimizer, launch):
    """Run `launch()` as the optimizer's own step runs (torch.optim.Optimizer's
    profile_hook_step): between its step pre- and post-hooks, global and its own, in its profiler
    range while a profiler records."""
    pre = torch_optimizer._global_optimizer_pre_hooks or optimizer._optimizer_step_pre_hooks
    post = torch_optimizer._global_optimizer_post_hooks or optimizer._optimizer_step_post_hooks
    if not (pre or post or torch.autograd._profiler_enabled()):
        launch()  # the usual step: nothing to call around it
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
        launch()
        optimizer._optimizer_step_code()
        for hook in itertools.chain(
            optimizer._optimizer_step_post_hooks.values(),
            torch_optimizer._global_optimizer_post_hooks.values(),
        ):
            hook(optimizer, args, kwargs)
