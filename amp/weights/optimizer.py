"""The owner of an optimizer under amp: the record amp keeps per optimizer, whose methods do the
work of the optimizer's step, zero_grad, add_param_group and (where torch's state-dict hooks do
not run: optimizer_state.py) state dicts once instrument.py has put them on the optimizer.

The record is made of parts, each handed the data it needs and none holding the record:
- the table (table.py): the parameters the optimizer steps, where they sit, and at O2 their FP32
  masters with the marks of amp's own writes;
- the gradient stash of scale_loss's blocks (grad_stash.py);
- the reports of its skipped steps (skip.py);
- at O2, the fused master step (fused_step.py) and, on the CuPy kernels, the deferred master
  gradients (deferral.py).
Each step's path (the fused step or the optimizer's own) and whether it is skipped are decided
here, once, in `step`. scale_loss opens and closes its blocks through `open_block` /
`close_block` / `drop_block`; a loss scaler asks `holds_scaled` before its scale changes.
"""

import functools
import types
import operator

import torch

from .. import distributed
from .._state import amp_state
from ..properties import COMPACT
from ..apex_interop.optimizer_wrappers import wrapped_optimizers
from . import engines, masters, optimizer_state
from .columns import GRAD, NONES, consume, repeat
from .fused_step import FusedStep
from .grad_stash import GradientStash
from .skip import Skips

__all__ = ["PATCHED_METHODS", "OptimizerRecord", "holds_scaled", "learn_skips", "replacement"]

# The optimizer methods amp replaces by the record's (not the state dicts where torch's hooks run)
PATCHED_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")


_LEARNED, _FOUND_VALUE = operator.attrgetter("learned"), operator.attrgetter("found_value")


class OptimizerRecord:
    """amp's bookkeeping for one optimizer, and the one place its steps are decided."""

    def __init__(self, optimizer, originals, table, fused, deferral, found_inf_on_device):
        self.optimizer = optimizer
        self.originals = originals  # the optimizer's own methods, called by the patched ones
        self.table = table
        self.stash = GradientStash(table)
        self.skips = Skips()
        self.pending = []  # the checks of its blocks since its last step (scale_loss's exit)
        self.stepped_fused = False  # whether a fused step was taken (compact state exists)
        self.fused = fused  # FusedStep at O2 for torch's AdamW/Adam/SGD, else None
        self.deferral = deferral  # Deferral at O2 on the CuPy kernels, else None
        # The next exit may keep the masters' gradients for the fused step (deferral.py): the
        # last step took it, or was the optimizer's own that made the state it needs.
        self.defers = False
        self.found_inf_on_device = found_inf_on_device  # its step takes the overflow flag
        self.inner = wrapped_optimizers(optimizer)  # the torch optimizers a wrapper holds
        self.state_hooks = None  # optimizer_state.StateDictHooks where torch's hooks run
        # zero_grad(set_to_none=False) was called: a step keeps the master gradients (zeroed by
        # the next zero_grad), as torch keeps `.grad`, so that a parameter unused in a step is
        # still stepped with its zero gradient (momentum, moments, weight decay)
        self.keeps_grads = False

    # -- scale_loss's blocks -------------------------------------------------------------------

    def open_block(self, scaler, delay_unscale, inv_scale, identity):
        """A scale_loss block of `scaler` opens (its loss scaled by `inv_scale`'s inverse).
        Returns the scaler whose scaled gradients the block would add its own to, if it is
        another (their sum would mix two scales), changing nothing then; else None."""
        stash = self.stash
        if stash.frames or stash.scaled_by is not None:
            theirs = stash.conflict(scaler, delay_unscale)
            if theirs is not None:
                return theirs
        if self.skips.waiting:  # a skip whose results arrived since: reported now
            self._poll()
        deferral = self.deferral
        if deferral is not None and deferral.kept is not None:
            deferral.materialize()  # gradients kept for the step join the accumulation
        holders = self.table.grad_holders(self.optimizer.param_groups)
        stash.enter(scaler, delay_unscale, inv_scale, identity, holders)
        return None

    def close_block(self, found_inf, check, unscaled=None):
        """The block exited normally: its gradients unscaled and checked into `found_inf`;
        `check` (or None, unchecked) decides whether the next step is skipped. `unscaled`: ids of
        parameters another optimizer of the same block unscaled already (they may share them
        without master weights), to which this one adds its own."""
        plain = self.table.plain_params(self.optimizer.param_groups)
        if unscaled is not None:
            plain = [param for param in plain if id(param) not in unscaled]
            unscaled.update(map(id, plain))
        self.stash.commit(found_inf, plain, self.deferral if self.defers else None)
        if check is not None:
            self.pending.append(check)

    def drop_block(self):
        """The block raised: the gradients are as they were when it opened."""
        self.stash.discard(self.table.grad_holders(self.optimizer.param_groups))

    # -- step ---------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        if (args or kwargs) and kwargs.get("closure", args[0] if args else None) is not None:
            raise RuntimeError(
                "Currently, Amp does not support closure use with optimizers. Call backward "
                "inside `with amp.scale_loss(loss, optimizer)` and then optimizer.step() with no "
                "closure."
            )
        table, stash = self.table, self.stash
        if not table.in_place():  # a parameter replaced since initialize is refused
            engines.check_places(table, "optimizer.step()")
        if stash.frames:
            raise RuntimeError(
                "optimizer.step() was called inside `with amp.scale_loss(...)`; the gradients "
                "are unscaled and checked when the block exits. Call step() after the block."
            )
        if stash.scaled_by is not None:
            raise RuntimeError(
                "optimizer.step(): the gradients are still scaled, because the last "
                "amp.scale_loss before it had delay_unscale=True. Give the last backward of an "
                "accumulation delay_unscale=False (it unscales them all), or call "
                "optimizer.zero_grad() to drop them."
            )
        if self.skips.waiting:  # earlier skips the device decided on, whose results may be here
            self._poll(wait=distributed.is_distributed())
        deferral = self.deferral
        kept = None if deferral is None else deferral.kept
        if table.models:  # O2: the masters take what reached the model around amp
            table.take_outside_writes()
            if not all(map(operator.is_, map(GRAD, table.models), NONES)):
                if kept is not None:  # gradients from a backward outside scale_loss join them
                    deferral.materialize()
                    kept = None
                stash.adopt_model_grads()
        optimizer = self.optimizer
        fused = self.fused
        # The path, decided once: amp's fused step where it applies, else the optimizer's own.
        # A plan over compact state makes a first step's state: only for a step known taken.
        planned = fused is None or fused.form is None
        plan = None if fused is None or not planned else fused.plan(optimizer, table, kept)
        checks, found, known = self.pending, None, True
        if checks:
            self.pending = []
            watch = amp_state.origin_watch
            if watch.armed:  # a watched step (the one after a skip) ends: its origin is found
                watch.settle(self.skips, checks)
            if not planned and not self.stepped_fused:
                for check in checks:
                    check.arrived(wait=True)
            if all(map(_LEARNED, checks)):  # the host knows, at no cost (always on the CPU)
                overflowed = list(filter(_FOUND_VALUE, checks))
            else:
                if not planned:
                    plan, planned = fused.plan(optimizer, table, kept), True
                on_device = plan is not None or self.found_inf_on_device
                overflowed, found, known = _decide(checks, on_device)
            if overflowed:
                self._skip(checks, kept)
                return None
        if not planned:
            plan = fused.plan(optimizer, table, kept)
        self.defers = plan is not None or (self.fused is not None and self.fused.stateless)
        if plan is not None:
            fused.run(optimizer, plan, found)
            self.stepped_fused = True
            if kept is not None:
                deferral.take()
            table.models_written(not self.keeps_grads)
            self._note_stepped()
            self._stepped(checks, known)
            return None
        if kept is not None:
            deferral.materialize()
        # Optimizer arithmetic is never cast: casting.autocast.policy_scope(None), inlined (it
        # runs every step, and a generator context manager's machinery is Python calls).
        thread = amp_state.thread
        saved = thread.policy
        thread.policy = None
        if found is not None:
            optimizer.found_inf = found  # torch's fused optimizers read it (grads are unscaled)
        try:
            result = self.originals["step"]()
        finally:
            thread.policy = saved
            if found is not None:
                del optimizer.found_inf
        if table.models:
            table.write_models(not self.keeps_grads)
        self._stepped(checks, known)
        return result

    def _skip(self, checks, kept):
        """Skip this step: report it, and drop the master gradients (kept or FP32)."""
        table, groups = self.table, self.optimizer.param_groups
        name_of = functools.partial(table.name_of, groups=groups)
        deferred = ()
        if kept is not None:  # low precision: their check knows which held inf/NaN
            deferred = tuple(map(name_of, kept.nonfinite_models()))
            self.deferral.take()  # before the masters' `.grad` are read (and made)
        names = distributed.nonfinite_names(table.plain_params(groups) + table.masters, name_of)
        if self.keeps_grads:  # as a zero_grad(set_to_none=False) would leave them
            for master in table.masters:
                if master.grad is not None:
                    master.grad.zero_()
        else:
            consume(map(setattr, table.masters, repeat("grad"), NONES))
        self._note_stepped()
        self.skips.skipped(checks, names + deferred)

    def _stepped(self, checks, known):
        if amp_state.cast_cache.filled:
            amp_state.cast_cache.clear()  # the weights changed
        if checks and not (known and amp_state.nonfinite_loss_run is None):
            self.skips.stepped(checks, known)

    def _note_stepped(self):
        """The user did call step() where amp did not call the optimizer's own: an LR scheduler
        made before amp.initialize, or one on the torch optimizer a wrapper holds (LARC), must
        not warn that its step() came first."""
        if getattr(self.originals["step"], "_wrapped_by_lr_sched", False):
            self.optimizer._opt_called = True
        for inner in self.inner:
            if getattr(inner.step, "_wrapped_by_lr_sched", False):
                inner._opt_called = True

    def _poll(self, wait=False):
        groups = self.optimizer.param_groups
        table = self.table
        name_of = functools.partial(table.name_of, groups=groups)
        self.skips.poll(table.plain_params(groups), name_of, wait)

    def anchor(self, places):
        """Remember where the parameters the optimizer steps sit in the models (`places`,
        engines.py's): a step checks that they are still there."""
        table = self.table
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        held = [p if m is None else m for p, m in zip(params, table.models_of(params))]
        table.anchor(held, places)

    def expose_masters(self):
        """amp.master_params(): the masters as the user sees them, outside writes taken in (a
        kept gradient is made FP32 when something reads it: deferral.py)."""
        self.table.take_outside_writes()

    # -- the rest of the optimizer API --------------------------------------------------------

    def state_dict(self):
        """Where the optimizer's state dicts run no torch hooks: its own, with the masters."""
        state = self.originals["state_dict"]()
        return optimizer_state.saved(self.optimizer, self.table, state)

    def load_state_dict(self, state_dict):
        """Where they run no torch hooks: the masters checked, the optimizer's own load, the
        masters written."""
        state_dict, pending = optimizer_state.loading(
            self.optimizer, self.table, state_dict, self.fused
        )
        self.originals["load_state_dict"](state_dict)
        optimizer_state.loaded(self.optimizer, self.table, *pending)

    def zero_grad(self, *args, **kwargs):
        if self.skips.waiting:  # a skip that arrived is reported while its gradients are there
            self._poll()
        to_none = not (args or kwargs) or kwargs.get("set_to_none", args[0] if args else True)
        if not to_none:
            self.keeps_grads = True
        deferral = self.deferral
        if deferral is not None and deferral.kept is not None:
            if to_none:  # before torch's zero_grad reads (and would make) them
                deferral.take()
            else:  # zeroed FP32 gradients, which a step then steps with, as on the general path
                deferral.materialize()
        # The arguments as given: a wrapper's zero_grad may take none (apex's LARC).
        self.originals["zero_grad"](*args, **kwargs)
        models = self.table.models
        if to_none:
            if models and not all(map(operator.is_, map(GRAD, models), NONES)):
                consume(map(setattr, models, repeat("grad"), NONES))
        else:
            for model_param in models:
                if model_param.grad is not None:
                    model_param.grad.detach_()
                    model_param.grad.zero_()
        stash = self.stash
        if stash.kept or stash.scaled_by is not None or stash.frames:
            stash.reset()
        self.pending = []  # the gradients an overflow was found in are gone, and the reason to skip

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
        new_rows = []
        properties = amp_state.properties
        if properties.master_weights:
            for i, param in enumerate(params or ()):
                if id(param) in amp_state.cast_params:
                    made = masters.master_for(param, self.table.compact)
                    if made is None:  # an optimizer steps it already, through its master
                        raise ValueError(self._stepped_already(param))
                    new_rows.append((param, *made))
                    params[i] = made[0]
        group = dict(param_group, params=params)
        self.originals["add_param_group"](group)
        for param, master, correction in new_rows:
            master.requires_grad_(param.requires_grad)
            masters.join(self.table, param, master, correction)
        if new_rows and self.fused is None:
            self.fused = FusedStep.made_for(
                self.optimizer,
                self.originals["step"],
                properties.master_weights == COMPACT,
                properties.optimizer_state,
            )
            if self.state_hooks is not None:
                self.state_hooks.fused = self.fused
        self.table.forget_groups()
        engines.anchor([self], amp_state.models)

    def _stepped_already(self, param):
        """add_param_group's error for a cast parameter an optimizer steps (as its master)."""
        if id(param) in self.table.index:  # torch's words: it would see the master only
            return "some parameters appear in more than one parameter group"
        return (
            "optimizer.add_param_group: the parameter is stepped by another optimizer passed to "
            "amp.initialize (as its FP32 master at O2); amp unscales and steps each parameter "
            "through one optimizer. Add it to that optimizer, or leave it out here."
        )

    def give_back(self):
        """Undo of master creation: the optimizer steps the model's own parameters again."""
        if self.deferral is not None and self.deferral.kept is not None:
            self.deferral.materialize()  # an FP32 model parameter takes its master's gradient
        masters.give_back(self.optimizer, self.table)


def _decide(checks, on_device):
    """Whether a step is skipped, where the host has not read every check yet: (the checks whose
    gradients held inf/NaN, the flag to hand to a step that takes it on the device or None,
    whether the host knew). The host decides where the copies have arrived, which costs no wait;
    else the device decides where it can; else the host reads the device flags (one sync per
    check, as apex's step did)."""
    for check in checks:
        if not check.arrived():
            break
    else:
        return list(filter(_FOUND_VALUE, checks)), None, True
    if on_device:
        found = checks[0].found
        for check in checks[1:]:
            found = torch.maximum(found, check.found)
        return [], found, False
    return [check for check in checks if check.is_set()], None, False


def holds_scaled(scaler):
    """Whether gradients scaled by `scaler` wait in some optimizer's stash to be unscaled (an
    open block, or an accumulation of delay_unscale blocks): its scale must not change."""
    return any(record.stash.holds(scaler) for record in amp_state.optimizers)


def learn_skips():
    """Every skip the host has not learned yet, learned and reported now (waiting for copies
    still on their way): what `amp.last_overflow()` and `amp.state_dict()` do first."""
    for record in amp_state.optimizers:
        record._poll(wait=True)


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


_REPLACEMENTS = {name: _delegate(name) for name in PATCHED_METHODS}


def replacement(optimizer, name, original):
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
