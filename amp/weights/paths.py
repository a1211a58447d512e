"""How O2 steps each parameter group, decided once by one function (`choose`) when the group is
made (amp.initialize, add_param_group), and the form of its masters (`master_form`).

- The fused path (owner.py): torch's AdamW, Adam and SGD with options the fused step computes
  (fused_step.py). amp steps them: the groups hold the model's parameters and each parameter's
  state entry its master's rest (an int16 remainder for bf16 models: exact masters in 4 bytes;
  an int8 correction with master_weights="compact"; FP32 masters for fp16 models) and its
  moments in the `optimizer_state` form.
- The general path (copies.py): any other optimizer, or one of those with options the fused
  step does not compute (amsgrad, a tensor lr, ...) or `AMP_FUSED_STEP=0`: FP32 masters in its
  groups, stepped by its own step. Compact state, which only the fused step keeps, is refused
  there with the reason.

An optimizer's groups share its path (instrument.py): a group added later whose path would
differ is refused. `AMP_FUSED_STEP=0` in the environment at `amp.initialize` turns the fused path
off: every optimizer is then stepped by its own step, on FP32 masters.
"""

import os

import torch

from ..properties import COMPACT
from . import fused_step
from .rows import CORRECTION, FP32, REMAINDER, MasterForm

__all__ = ["FUSED", "GENERAL", "FUSED_STEP_ENV", "kind_of", "why_not", "master_form", "choose"]

FUSED, GENERAL = "fused", "general"
FUSED_STEP_ENV = "AMP_FUSED_STEP"  # "0" at amp.initialize: every O2 step is the optimizer's own
_KINDS = {torch.optim.AdamW: "adam", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}


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


def master_form(properties, path=FUSED):
    """The form of the masters on `path` (rows.MasterForm), None without master weights."""
    dtype = properties.cast_model_type
    if not properties.master_weights or dtype not in (torch.float16, torch.bfloat16):
        return None
    if properties.master_weights == COMPACT:
        return MasterForm(CORRECTION, dtype)
    if dtype is torch.bfloat16 and path == FUSED:
        return MasterForm(REMAINDER, dtype)
    return MasterForm(FP32, dtype)


def _what(properties):
    if properties.master_weights == COMPACT:
        return "master_weights='compact'"
    return f"optimizer_state={properties.optimizer_state!r}"


def choose(optimizer, group, properties, where, kind=None):
    """(FUSED or GENERAL, the reason it is not fused or None) for `group` of `optimizer` (whose
    kind the fused step knows already where `kind` is given: a group added to an optimizer amp
    steps); a ValueError naming the reason where compact state is asked for off the fused path.
    Changes nothing."""
    reason = None if kind is not None else why_not(optimizer)
    if reason is None:
        reason = fused_step.uncovered(kind or kind_of(optimizer), group)
    if reason is not None and properties.compact:
        raise ValueError(
            f"amp.initialize: {_what(properties)} is kept by amp's fused master step, which "
            "steps torch.optim.AdamW, Adam and SGD (without amsgrad, maximize, capturable or "
            f"differentiable, with number hyperparameters); {where}: {reason}. Use one of "
            "those, or master_weights=True with optimizer_state='fp32'."
        )
    return (FUSED, None) if reason is None else (GENERAL, reason)
