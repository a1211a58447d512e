"""The record amp keeps per optimizer, whose methods do the work of the optimizer's step,
zero_grad, add_param_group and (where torch's state-dict hooks do not run: optimizer_state.py)
state dicts once paths.py has put them on the optimizer.

The record is made of parts, each handed the data it needs and none holding the record:
- at O2 the owner of the optimizer's master weights and state (owner.py, which amp steps, or
  copies.py, FP32 masters its own step steps), chosen by paths.py;
- the gradient stash of scale_loss's blocks (grad_stash.py);
- the reports of its skipped steps (skip.py);
- where its parameters sit in the models (engines.Places).
Each step's path and whether it is skipped are decided here, once, in `step`. scale_loss opens
and closes its blocks through `open_block` / `close_block` / `drop_block`; a loss scaler asks
`holds_scaled` before its scale changes.
"""

import functools
import operator
import types

import torch

from .. import distributed
from .._state import amp_state
from ..apex_interop.optimizer_wrappers import wrapped_optimizers
from . import engines, fused_step, optimizer_state
from .copies import MasterCopies
from .param_groups import add_param_group
from .grad_stash import GradientStash
from .owner import StateOwner
from .skip import Skips

__all__ = ["PATCHED_METHODS", "OptimizerRecord", "holds_scaled", "learn_skips", "replacement"]

# The optimizer methods amp replaces by the record's (not the state dicts where torch's hooks run)
PATCHED_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")

_LEARNED, _FOUND_VALUE = operator.attrgetter("learned"), operator.attrgetter("found_value")
_PARAMS = operator.itemgetter("params")


class OptimizerRecord:
    """amp's bookkeeping for one optimizer, and the one place its steps are decided."""

    def __init__(self, optimizer, originals, owner, found_inf_on_device):
        self.optimizer = optimizer
        self.originals = originals  # the optimizer's own methods, called by the patched ones
        self.owner = owner  # O2: StateOwner or MasterCopies; else None
        self.stash = GradientStash(owner)
        self.skips = Skips()
        self.places = engines.Places()
        self.pending = []  # the checks of its blocks since its last step (scale_loss's exit)
        self.found_inf_on_device = found_inf_on_device  # its own step takes the overflow flag
        self.inner = wrapped_optimizers(optimizer)  # the torch optimizers a wrapper holds
        # zero_grad(set_to_none=False) was called: a step keeps the master gradients (zeroed by
        # the next zero_grad), as torch keeps `.grad`, so that a parameter unused in a step is
        # still stepped with its zero gradient (momentum, moments, weight decay)
        self.keeps_grads = False
        self._plain = (None, [])  # (the param groups' lengths, their parameters without a row)
        self.sharded = False  # some parameters are DTensors (FSDP2): unscale their local shards

    # -- the parameters ------------------------------------------------------------------------

    def plain_params(self):
        """The parameters of the groups with no row (kept while the groups' lengths stay)."""
        groups = self.optimizer.param_groups
        signature = tuple(map(len, map(_PARAMS, groups)))
        cached_signature, params = self._plain
        if signature != cached_signature:
            owner = self.owner
            if owner is None:
                params = [p for group in groups for p in group["params"]]
            else:
                params = owner.plain(groups)
            self._plain = (signature, params)
            self.sharded = distributed.has_dtensors(params)
        return params  # shared: callers do not modify it

    def grad_holders(self):
        """Every tensor whose `.grad` a backward of the optimizer's loss writes."""
        plain = self.plain_params()
        owner = self.owner
        return plain + owner.params if owner is not None and owner.params else plain

    def name_of(self, param):
        """The qualified name of a parameter the optimizer steps (of a master: its model
        parameter's; of a gradient's holder: its parameter's)."""
        param = getattr(param, "param", param)
        owner = self.owner
        if isinstance(owner, MasterCopies):
            model = owner.model_of(param)
            param = param if model is None else model
        return self.places.name_of(param, self.optimizer.param_groups)

    def anchor(self, places):
        """Remember where the parameters the optimizer steps sit in the models (`places`,
        engines.py's): a step checks that they are still there."""
        owner = self.owner
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if isinstance(owner, MasterCopies):
            models = map(owner.model_of, params)
            params = [p if model is None else model for p, model in zip(params, models)]
        self.places.anchor(params, places)

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
        owner = self.owner
        if owner is not None and (owner.kept is not None or owner.copies):
            owner.open_block()  # the master gradients held for the step join the accumulation
        stash.enter(scaler, delay_unscale, inv_scale, identity, self.grad_holders())
        return None

    def close_block(self, found_inf, check, unscaled=None):
        """The block exited normally: its gradients unscaled and checked into `found_inf`;
        `check` (or None, unchecked) decides whether the next step is skipped. `unscaled`: ids of
        parameters another optimizer of the same block unscaled already (they may share them
        without master weights), to which this one adds its own."""
        plain = self.plain_params()
        if unscaled is not None:
            plain = [param for param in plain if id(param) not in unscaled]
            unscaled.update(map(id, plain))
        self.stash.commit(found_inf, plain, self.sharded)
        owner = self.owner
        if owner is not None and owner._handed_weak and not self.stash.frames:
            owner.exited()
        if check is not None:
            self.pending.append(check)

    def drop_block(self):
        """The block raised: the gradients are as they were when it opened."""
        self.stash.discard(self.grad_holders())

    # -- step ---------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        if (args or kwargs) and kwargs.get("closure", args[0] if args else None) is not None:
            raise RuntimeError(
                "Currently, Amp does not support closure use with optimizers. Call backward "
                "inside `with amp.scale_loss(loss, optimizer)` and then optimizer.step() with no "
                "closure."
            )
        stash = self.stash
        places = self.places  # a parameter replaced since initialize is refused (in_place, inlined)
        if not all(map(operator.is_, map(dict.get, places.dicts, places.names), places.params)):
            engines.check_places(places, "optimizer.step()")
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
        owner = self.owner
        fused = isinstance(owner, StateOwner)
        if owner is not None:
            if not fused:  # the rows take what reached the model around amp (the fused step's own)
                owner.take_writes()
            if not owner.grads_in_model:
                stash.adopt_model_grads()
        checks, found, known = self.pending, None, True
        if checks:
            self.pending = []
            watch = amp_state.origin_watch
            if watch.armed:  # a watched step (the one after a skip) ends: its origin is found
                watch.settle(self.skips, checks)
            if all(map(_LEARNED, checks)):  # the host knows, at no cost (always on the CPU)
                overflowed = list(filter(_FOUND_VALUE, checks))
            else:
                on_device = fused or self.found_inf_on_device
                overflowed, found, known = _decide(checks, on_device)
            if overflowed:
                self._skip(checks)
                return None
        if fused:

            def learn():  # the state a first step makes waits for the step to be known taken
                for check in checks:
                    check.arrived(wait=True)
                return any(map(_FOUND_VALUE, checks))

            if not fused_step.step(owner, found, learn, self.keeps_grads):
                self._skip(checks)
                return None
            self._note_stepped()
            self._stepped(checks, known)
            return None
        # Optimizer arithmetic is never cast: casting.autocast.policy_scope(None), inlined (it
        # runs every step, and a generator context manager's machinery is Python calls).
        thread = amp_state.thread
        saved = thread.policy
        thread.policy = None
        if found is not None:
            self.optimizer.found_inf = found  # torch's fused optimizers read it (grads unscaled)
        try:
            result = self.originals["step"]()
        finally:
            thread.policy = saved
            if found is not None:
                del self.optimizer.found_inf
        if owner is not None:
            owner.write_models()
            owner.drop_grads(zero=self.keeps_grads)
        self._stepped(checks, known)
        return result

    def _skip(self, checks):
        """Skip this step: report it, and drop the master gradients."""
        owner = self.owner
        held = self.plain_params()
        if isinstance(owner, StateOwner):
            held = held + [_GradOf(param, grad) for param, grad in owner.held_grads()]
        elif owner is not None:
            held = held + owner.masters
        names = distributed.nonfinite_names(held, self.name_of)
        if owner is not None:
            owner.drop_grads(zero=self.keeps_grads)
        self._note_stepped()
        self.skips.skipped(checks, names)

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
        self.skips.poll(self.plain_params(), self.name_of, wait)

    def master_params(self):
        """amp.master_params(): the parameters the optimizer steps, FP32 (an owner's masters, with
        their FP32 gradients)."""
        owner = self.owner
        if owner is None:
            return [p for group in self.optimizer.param_groups for p in group["params"]]
        with amp_state.lock:  # a reader in another thread and the step: one at a time
            return owner.master_params()

    # -- the rest of the optimizer API --------------------------------------------------------

    def state_dict(self):
        """Where the optimizer's state dicts run no torch hooks: its own, with the masters."""
        state = self.originals["state_dict"]()
        return state if self.owner is None else optimizer_state.saved(
            self.optimizer, self.owner, state
        )

    def load_state_dict(self, state_dict):
        """Where they run no torch hooks: checked and converted, the optimizer's own load, the
        masters written."""
        if self.owner is None:
            self.originals["load_state_dict"](state_dict)
            return
        state_dict, pending = optimizer_state.loading(self.optimizer, self.owner, state_dict)
        self.originals["load_state_dict"](state_dict)
        optimizer_state.loaded(self.optimizer, self.owner, pending)

    def zero_grad(self, *args, **kwargs):
        if self.skips.waiting:  # a skip that arrived is reported while its gradients are there
            self._poll()
        to_none = not (args or kwargs) or kwargs.get("set_to_none", args[0] if args else True)
        if not to_none:
            self.keeps_grads = True
        owner = self.owner
        # What an owner holds apart from the parameters' `.grad`, which torch's zero_grad drops
        if owner is not None and (
            not to_none or owner.kept is not None or owner.grads or owner.handed or owner.copies
        ):
            owner.drop_grads(zero=not to_none)
        # The arguments as given: a wrapper's zero_grad may take none (apex's LARC).
        self.originals["zero_grad"](*args, **kwargs)
        if isinstance(owner, MasterCopies):
            models = owner.params
            if to_none:
                consume_grads = [p for p in models if p.grad is not None]
                for param in consume_grads:
                    param.grad = None
            else:
                for param in models:
                    if param.grad is not None:
                        param.grad.detach_()
                        param.grad.zero_()
        stash = self.stash
        if stash.kept or stash.scaled_by is not None or stash.frames:
            stash.reset()
        self.pending = []  # the gradients an overflow was found in are gone, and the reason to skip

    add_param_group = add_param_group  # param_groups.py's, which takes the record


class _GradOf:
    """A gradient's holder for a skip's report: the parameter it is of, and the gradient."""

    __slots__ = ("param", "grad")

    def __init__(self, param, grad):
        self.param, self.grad = param, grad


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
