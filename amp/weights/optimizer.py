"""Optimizer instrumentation: the record amp keeps per optimizer and the methods it patches.

The concerns live in their own modules: master weights (masters.py), the gradient stash of
scale_loss (grad_stash.py), skipped steps (skip.py) and state dicts with masters
(optimizer_state.py). This module ties them to the optimizer's step, zero_grad and
add_param_group.
"""

import functools
import itertools
import types

import torch

from .._state import amp_state
from ..apex_interop.optimizer_wrappers import require_optimizer_like
from .grad_stash import GradientStash, set_each
from .skip import SkipDecision
from . import engines, optimizer_state
from .masters import MasterWeights, match_state_to_params, new_master

MASTER_PARAMS_KEY = optimizer_state.MASTER_PARAMS_KEY

_PATCHED_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")


def check_optimizer(optimizer, index):
    require_optimizer_like(optimizer, f"amp.initialize: optimizers[{index}]")
    if "_amp_record" in vars(optimizer):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")


class OptimizerRecord(MasterWeights):
    """amp's bookkeeping for one optimizer."""

    def __init__(self, optimizer, names):
        super().__init__(optimizer)
        self.names = names  # id(model parameter) -> qualified name, for overflow reports
        self.originals = {}  # the optimizer's own methods, called by the patched ones
        self.stash = GradientStash(self)
        self.skips = SkipDecision(self)

    def param_name(self, param):
        for model_param, master in self.master_pairs:
            if master is param:
                param = model_param
                break
        name = self.names.get(id(param))
        if name is None:
            for group_index, group in enumerate(self.optimizer.param_groups):
                for param_index, candidate in enumerate(group["params"]):
                    if candidate is param:
                        return f"param_groups[{group_index}]['params'][{param_index}]"
        return name

    # -- step ---------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        if (args or kwargs) and kwargs.get("closure", args[0] if args else None) is not None:
            raise RuntimeError(
                "Currently, Amp does not support closure use with optimizers. Call backward "
                "inside `with amp.scale_loss(loss, optimizer)` and then optimizer.step() with no "
                "closure."
            )
        watch = amp_state.parameter_watch  # a parameter replaced since initialize is refused
        if watch is not None:
            watch.check("optimizer.step()")
        if self.stash.frames:
            raise RuntimeError(
                "optimizer.step() was called inside `with amp.scale_loss(...)`; the gradients "
                "are unscaled and checked when the block exits. Call step() after the block."
            )
        if self.stash.scaled_by is not None:
            raise RuntimeError(
                "optimizer.step(): the gradients are still scaled, because the last "
                "amp.scale_loss before it had delay_unscale=True. Give the last backward of an "
                "accumulation delay_unscale=False (it unscales them all), or call "
                "optimizer.zero_grad() to drop them."
            )
        overflowed = self.skips.take()
        if overflowed:
            self.skips.skip(overflowed)
            return None
        if self.models:  # O2 (no call at all at O1 or O3)
            self.before_step()
        # Optimizer arithmetic is never cast: casting.autocast.policy_scope(None), inlined (it
        # runs every step, and a generator context manager costs six Python calls).
        thread = amp_state.thread
        saved = thread.policy
        thread.policy = None
        try:
            result = self.originals["step"]()
        finally:
            thread.policy = saved
        if self.models:
            self.after_step()
        if amp_state.cast_cache.filled:
            amp_state.cast_cache.clear()  # the weights changed
        return result

    # -- the rest of the optimizer API --------------------------------------------------------

    def state_dict(self):
        return optimizer_state.state_dict(self)

    def load_state_dict(self, state_dict):
        optimizer_state.load_state_dict(self, state_dict)

    def zero_grad(self, *args, **kwargs):
        # The arguments as given: a wrapper's zero_grad may take none (apex's LARC).
        self.originals["zero_grad"](*args, **kwargs)
        if not (args or kwargs) or kwargs.get("set_to_none", args[0] if args else True):
            set_each(self.models, "grad", itertools.repeat(None))
        else:
            for model_param in self.models:
                if model_param.grad is not None:
                    model_param.grad.detach_()
                    model_param.grad.zero_()
        self.stash.reset()
        self.skips.pending = []  # the gradients an overflow was found in are gone

    def add_param_group(self, param_group):
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
        new_pairs = []
        if amp_state.properties.master_weights:
            for i, param in enumerate(params or ()):
                if id(param) in amp_state.cast_params and id(param) not in amp_state.masters:
                    shadow = amp_state.shadows.get(id(param))
                    # A frozen parameter's FP32 copy becomes its master: its exact FP32 value.
                    master = shadow.fp32 if shadow is not None else new_master(param)
                    new_pairs.append((param, master))
                    params[i] = master
        group = dict(param_group, params=params)
        self.originals["add_param_group"](group)
        for param, master in new_pairs:
            master.requires_grad_(param.requires_grad)
            self.add_master(param, master)
        self.forget_param_groups()


def _delegate(name):
    """The method amp puts on an optimizer instance: amp's record does the work, or the
    optimizer's own class once amp.deinitialize() ran (or on a copy, which has no record)."""

    of_record = getattr(OptimizerRecord, name)

    def method(self, *args, **kwargs):
        record = self.__dict__.get("_amp_record")
        if record is None:
            return getattr(type(self), name)(self, *args, **kwargs)
        return of_record(record, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


_REPLACEMENTS = {name: _delegate(name) for name in _PATCHED_METHODS}


def _replacement(optimizer, name, original):
    """The bound amp method for `optimizer.name`.

    A bound method, so that an LR scheduler made later can wrap it (it reads `step.__func__`);
    but when a scheduler made earlier already wrapped `step`, a function that keeps its mark, so
    that the scheduler does not warn that step was overridden.
    """
    function = _REPLACEMENTS[name]
    if not getattr(original, "_wrapped_by_lr_sched", False):
        return types.MethodType(function, optimizer)

    @functools.wraps(function)
    def step(*args, **kwargs):
        return function(optimizer, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


def instrument(optimizer, params_with_masters, names, ledger):
    """Set `optimizer` up for amp: FP32 masters for `params_with_masters` (ids), patched methods.

    Must run before the model is cast, so the masters are the exact FP32 weights.
    """
    record = OptimizerRecord(optimizer, names)
    # Runs last on undo, after the model has its FP32 weights back.
    ledger.add_undo(
        "optimizer state in the parameters' dtype", lambda: match_state_to_params(optimizer)
    )
    if params_with_masters:
        ledger.add_undo("optimizer steps its model parameters again", record.give_back_model_params)
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if id(param) in params_with_masters:
                    master = new_master(param)
                    param.grad = None
                    group["params"][index] = master
                    if param in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(param)
                    record.add_master(param, master)
        engines.follow_masters(optimizer, record.master_pairs, ledger)
    for name in _PATCHED_METHODS:
        if name == "add_param_group" and not hasattr(optimizer, name):
            continue  # an optimizer wrapper without it (optional, see apex_interop/optimizer_wrappers.py)
        record.originals[name] = getattr(optimizer, name)
        ledger.patch(
            optimizer, name, lambda original, name=name: _replacement(optimizer, name, original)
        )
    vars(optimizer)["_amp_record"] = record
    ledger.add_undo("forget the optimizer", lambda: vars(optimizer).pop("_amp_record", None))
    return record
