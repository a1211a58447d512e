"""Skipped steps: the checks of an optimizer's scale_loss blocks (scaling/checks.py), the decision
to skip its step, and the report of a step that was skipped.

The host decides where it knows, which costs no wait: when the copies of a step's checks have
reached the host by the step (always on the CPU), it skips or steps on their values. Where they
have not, an optimizer that takes the overflow flag on the device (torch's fused optimizers,
amp's fused master step) steps with it and the device skips; the general path, which must decide
on the host whether to call an arbitrary optimizer, reads the flag (a sync on CUDA). A skip the
host learns of later is reported then: at the next step, zero_grad or scale_loss, or when asked
(`amp.last_overflow()`, `amp.state_dict()`); in a distributed run at the next step, so that every
rank reports at the same point (naming the parameters is a collective).
"""

import torch

from .. import distributed
from .._state import amp_state, logger
from ..apex_interop.optimizer_wrappers import wrapped_optimizers
from ..diagnostics import nonfinite_loss
from ..diagnostics.overflow import OverflowReport

__all__ = ["SkipDecision", "learn_all"]


class SkipDecision:
    """The checks of an optimizer's blocks since its last step, and those whose step the device
    took before the host learned them."""

    def __init__(self, record):
        self.record = record
        self.pending = []  # Checks of the blocks since the last step, from scale_loss's exit
        self.waiting = []  # Checks the device decided on; to report once their copies arrive

    def add(self, check):
        self.pending.append(check)

    def drop(self):
        """zero_grad(): the gradients an overflow was found in are gone, and so is the reason to
        skip."""
        self.pending = []

    def take(self):
        """The pending checks, for the step about to run. A watched step (the one after a skip)
        ends here: its hooks go and its origin is found."""
        pending, self.pending = self.pending, []
        watch = amp_state.origin_watch
        if watch.armed:
            watch.settle(self.record, pending)
        return pending

    @staticmethod
    def decide(checks, on_device):
        """At a step: (the checks whose gradients held inf/NaN, the flag to hand to an optimizer
        that takes it on the device or None, whether the host knew). The host decides where
        the copies have arrived, which costs no wait; else the device decides when it can;
        else the host reads the device flags (one sync per check, as apex's step did)."""
        for check in checks:
            if not check.arrived():
                break
        else:
            return [check for check in checks if check.found_value], None, True
        if on_device:
            found = checks[0].found
            for check in checks[1:]:
                found = torch.maximum(found, check.found)
            return [], found, False
        return [check for check in checks if check.is_set()], None, False

    def skip(self, overflowed, checks):
        """Skip this step: drop the master gradients and report it (the host knows now)."""
        record = self.record
        self.note_stepped()
        for check in checks:  # the step read the device: the copies have arrived
            check.arrived(wait=True)
        masters = record.masters
        deferred = ()
        if masters is not None and masters.deferred is not None:  # kept low precision: their
            deferred = tuple(map(record.param_name, masters.nonfinite_models()))  # check knows
            masters.forget_deferred()  # before the masters' `.grad` are read (and made)
        names = distributed.nonfinite_names(
            record.plain_params() + record.table.masters, record.param_name
        )
        names += deferred
        if masters is not None:
            masters.drop_grads()
        self._learned(checks, names)

    def note_stepped(self):
        """The user did call step(): an LR scheduler made before amp.initialize, or one on the
        torch optimizer a wrapper holds (LARC), must not warn that its step() came first."""
        record = self.record
        if getattr(record.originals["step"], "_wrapped_by_lr_sched", False):
            record.optimizer._opt_called = True
        for inner in wrapped_optimizers(record.optimizer):
            if getattr(inner.step, "_wrapped_by_lr_sched", False):
                inner._opt_called = True

    def stepped(self, checks, known):
        """The step ran: checks the host knew are settled now, the others once they arrive."""
        if known:
            self._learned(checks, ())
        else:
            self.waiting.extend(checks)

    def poll(self, wait=False):
        """Report the skips the device decided on whose checks have arrived since (all, waiting
        for them, if `wait`). In a distributed run only at a step or when asked."""
        waiting = self.waiting
        if not waiting or (not wait and distributed.is_distributed()):
            return
        done = 0
        for check in waiting:
            if not check.arrived(wait):
                break
            done += 1
        if done:
            learned, self.waiting = waiting[:done], waiting[done:]
            names = ()
            if any(check.found_value for check in learned):
                record = self.record  # the gradients of that step, if no zero_grad dropped them
                names = distributed.nonfinite_names(record.plain_params(), record.param_name)
            self._learned(learned, names)

    def _learned(self, checks, names):
        """The host knows `checks`: report those that overflowed, and let a run of non-finite
        losses end at a clean one."""
        watch = amp_state.origin_watch
        bad_loss = fresh = clean = skipped = False
        for check in checks:
            if not check.found_value:
                clean = True
                continue
            skipped = True
            check.host_scale.read(wait=True, through=check)  # the scale after it
            origin = watch.origin_for(check)
            loss_finite = not check.bad_value
            params = tuple(names)
            previous = amp_state.last_overflow
            again = check.reported  # another optimizer of the same block: its parameters join
            if again and previous is not None and previous.flag is check:
                params = previous.params + tuple(n for n in names if n not in previous.params)
            check.reported = True
            report = OverflowReport(
                check.loss_id,
                params,
                check.scale_after,
                origin=origin,
                nonfinite_loss=not loss_finite,
            )
            report.flag = check
            amp_state.last_overflow = report
            if loss_finite:
                message = (
                    f"Gradient overflow.  Skipping step, loss scaler {check.loss_id} reducing "
                    f"loss scale to {report.loss_scale}"
                )
            else:
                # apex's words first: scripts count skipped steps by them
                message = (
                    f"Gradient overflow.  Skipping step, loss scaler {check.loss_id} keeping "
                    f"loss scale at {report.loss_scale}: the loss itself is inf or NaN"
                )
            if not again:  # the first optimizer of that loss speaks for the run of bad losses
                fresh = True
                if not loss_finite:
                    bad_loss = True
                    nonfinite_loss.after_bad_loss(check.loss_id, origin, watch.watched(check))
            if amp_state.verbosity >= 2:
                message += f"; non-finite gradients in: {', '.join(names) or 'none left'}"
            if amp_state.verbosity >= 1:
                if origin is not None:
                    message += f"; it started in {origin}"
                logger.info(message)
        if (clean or fresh) and not bad_loss and amp_state.nonfinite_loss_run is not None:
            nonfinite_loss.after_clean_step()
        if skipped:
            watch.arm(self.record)


def learn_all(records):
    """Every skip the host has not learned yet, learned and reported now (waiting for copies
    still on their way): what `amp.last_overflow()` and `amp.state_dict()` do first."""
    for record in records:
        record.skips.poll(wait=True)
