"""Optimizer instrumentation: the record amp keeps per optimizer and the methods it patches.

The record is composed of the optimizer's table (table.py: the parameters it steps, where they
sit, and at O2 their masters), the O2 master handling (masters.py; none at O1 and O3), the
gradient stash of scale_loss (grad_stash.py), the skip decision (skip.py) and state dicts with
masters (optimizer_state.py). This module ties them to the optimizer's step, zero_grad and
add_param_group.
"""

import functools
import inspect
import itertools
import operator
import types

import torch

from .. import distributed, kernels
from .._state import amp_state
from ..apex_interop.optimizer_wrappers import require_optimizer_like
from . import engines, optimizer_state
from .grad_stash import GradientStash
from .masters import Masters, master_for, match_state_to_params, new_master
from .skip import SkipDecision
from .columns import set_each
from .table import ParamTable

__all__ = [
    "MASTER_PARAMS_KEY",
    "check_optimizer",
    "OptimizerRecord",
    "takes_found_inf",
    "instrument",
]

MASTER_PARAMS_KEY = optimizer_state.MASTER_PARAMS_KEY

_PATCHED_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")
_PARAMS = operator.itemgetter("params")


def check_optimizer(optimizer, index):
    require_optimizer_like(optimizer, f"amp.initialize: optimizers[{index}]")
    if "_amp_record" in vars(optimizer):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")


class OptimizerRecord:
    """amp's bookkeeping for one optimizer."""

    def __init__(self, optimizer, names):
        self.optimizer = optimizer
        self.names = names  # id(model parameter) -> qualified name, for overflow reports
        self.originals = {}  # the optimizer's own methods, called by the patched ones
        self.table = ParamTable()
        self.masters = None  # Masters at O2
        self.stash = GradientStash(self)
        self.skips = SkipDecision(self)
        self.found_inf_on_device = False  # its step takes the overflow flag (set by instrument)
        self._plain_cache = (None, [])
        self.sharded = False  # some parameters are DTensors (FSDP2): unscale their local shards

    def param_name(self, param):
        table = self.table
        of_master = dict(zip(map(id, table.masters), table.models))
        param = of_master.get(id(param), param)
        name = self.names.get(id(param))
        if name is None:
            for group_index, group in enumerate(self.optimizer.param_groups):
                for param_index, candidate in enumerate(group["params"]):
                    if candidate is param or of_master.get(id(candidate)) is param:
                        return f"param_groups[{group_index}]['params'][{param_index}]"
        return name

    def stepped_params(self):
        """The parameters this optimizer steps, as the model holds them (O2: the cast ones, not
        their masters)."""
        of_master = dict(zip(map(id, self.table.masters), self.table.models))
        groups = self.optimizer.param_groups
        return [of_master.get(id(p), p) for group in groups for p in group["params"]]

    def grad_holders(self):
        """Every tensor whose `.grad` a backward of this optimizer's loss writes."""
        if self.masters is None:
            return self.plain_params()
        return self.plain_params() + self.table.models

    def plain_params(self):
        """The optimizer's parameters that are not FP32 masters (cached by group shape)."""
        groups = self.optimizer.param_groups
        signature = tuple(map(len, map(_PARAMS, groups)))
        cached_signature, params = self._plain_cache
        if signature != cached_signature:
            masters = set(map(id, self.table.masters))
            params = [p for group in groups for p in group["params"] if id(p) not in masters]
            self._plain_cache = (signature, params)
            self.sharded = distributed.has_dtensors(params)  # FSDP2: unscale the local shards
        return params  # shared: callers do not modify it

    def forget_param_groups(self):
        self._plain_cache = (None, [])

    # -- step ---------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        if (args or kwargs) and kwargs.get("closure", args[0] if args else None) is not None:
            raise RuntimeError(
                "Currently, Amp does not support closure use with optimizers. Call backward "
                "inside `with amp.scale_loss(loss, optimizer)` and then optimizer.step() with no "
                "closure."
            )
        if not self.table.in_place():  # a parameter replaced since initialize is refused
            engines.check_places(self.table, "optimizer.step()")
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
        skips = self.skips
        if skips.waiting:  # earlier skips the device decided on, whose results may have arrived
            skips.poll(wait=distributed.is_distributed())
        masters = self.masters
        plan = masters.fused.plan() if masters is not None else None  # amp's fused step applies
        checks = skips.take() if skips.pending else ()
        found, known = None, True
        if checks:
            on_device = plan is not None or self.found_inf_on_device
            overflowed, found, known = skips.decide(checks, on_device)
            if overflowed:
                skips.skip(overflowed, checks)
                return None
        if masters is not None:  # O2 (no call at all at O1 or O3)
            masters.before_step()
            if plan is not None and masters.fused.run(plan, found, masters.deferred):
                masters.after_fused_step()
                skips.note_stepped()
                self._stepped(checks, known)
                return None
            if found is not None and not self.found_inf_on_device:
                # No state yet (the first step is the optimizer's own): the host decides.
                overflowed = [check for check in checks if check.is_set()]
                if overflowed:
                    skips.skip(overflowed, checks)
                    return None
                found = None
            if masters.deferred is not None:
                masters.materialize()
        # Optimizer arithmetic is never cast: casting.autocast.policy_scope(None), inlined (it
        # runs every step, and a generator context manager's machinery is Python calls).
        thread = amp_state.thread
        saved = thread.policy
        thread.policy = None
        optimizer = self.optimizer
        if found is not None:
            optimizer.found_inf = found  # torch's fused optimizers read it (grads are unscaled)
        try:
            result = self.originals["step"]()
        finally:
            thread.policy = saved
            if found is not None:
                del optimizer.found_inf
        if masters is not None:
            masters.after_step()
        self._stepped(checks, known)
        return result

    def _stepped(self, checks, known):
        if amp_state.cast_cache.filled:
            amp_state.cast_cache.clear()  # the weights changed
        if checks and not (known and amp_state.nonfinite_loss_run is None):
            self.skips.stepped(checks, known)

    def defers(self, device):
        """Whether scale_loss's exit keeps this optimizer's master gradients low precision for
        the fused step (the CuPy kernels and a fused step that applies)."""
        masters = self.masters
        return kernels.fuses(device) and masters.fused.plan() is not None

    def expose_masters(self):
        """amp.master_params(): the masters as the user sees them, outside writes taken in (a
        deferred gradient is made FP32 when something reads it: masters.Deferred)."""
        if self.masters is not None:
            self.masters.take_outside_writes()

    # -- the rest of the optimizer API --------------------------------------------------------

    def state_dict(self):
        return optimizer_state.state_dict(self)

    def load_state_dict(self, state_dict):
        optimizer_state.load_state_dict(self, state_dict)

    def zero_grad(self, *args, **kwargs):
        if self.skips.waiting:  # a skip that arrived is reported while its gradients are there
            self.skips.poll()
        to_none = not (args or kwargs) or kwargs.get("set_to_none", args[0] if args else True)
        masters = self.masters
        if masters is not None and masters.deferred is not None:
            if to_none:  # before torch's zero_grad reads (and would make) them
                masters.forget_deferred()
            else:  # zeroed FP32 gradients, which a step then steps with, as on the general path
                masters.materialize()
        # The arguments as given: a wrapper's zero_grad may take none (apex's LARC).
        self.originals["zero_grad"](*args, **kwargs)
        if to_none:
            set_each(self.table.models, "grad", itertools.repeat(None))
        else:
            for model_param in self.table.models:
                if model_param.grad is not None:
                    model_param.grad.detach_()
                    model_param.grad.zero_()
        self.stash.reset()
        if self.skips.pending:
            self.skips.drop()

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
                if id(param) in amp_state.cast_params:
                    master = master_for(param)  # None: an optimizer steps it already
                    if master is not None:
                        new_pairs.append((param, master))
                        params[i] = master
        group = dict(param_group, params=params)
        self.originals["add_param_group"](group)
        if new_pairs and self.masters is None:
            self.masters = Masters(self)
        for param, master in new_pairs:
            master.requires_grad_(param.requires_grad)
            self.masters.add(param, master)
        self.forget_param_groups()
        engines.anchor([self], amp_state.models)


def takes_found_inf(optimizer):
    """Whether `optimizer.step` takes the overflow flag on the device: torch's fused optimizers
    (`_step_supports_amp_scaling`), whose step reads `found_inf` (not the older form that takes
    the scaler as `grad_scaler=`)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return "grad_scaler" not in inspect.signature(optimizer.step).parameters


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
    record.found_inf_on_device = takes_found_inf(optimizer)
    # Runs last on undo, after the model has its FP32 weights back.
    ledger.add_undo(
        "optimizer state in the parameters' dtype", lambda: match_state_to_params(optimizer)
    )
    table = record.table
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            if id(param) in params_with_masters:
                master = new_master(param)
                param.grad = None
                group["params"][index] = master
                if param in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(param)
                table.add_master(param, master)
    if table.models:
        record.masters = Masters(record)
        ledger.add_undo("optimizer steps its model parameters again", record.masters.give_back)
        engines.follow_masters(optimizer, list(zip(table.models, table.masters)), ledger)
    amp_state.tables.append(table)
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
