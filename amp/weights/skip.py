"""Skipped steps as the host learns of them: the report of each (the log message, the overflow
report amp.last_overflow() returns, the origin watch of the step after it, the non-finite-loss
warning) and the checks of steps the device decided on, reported once their copies arrive.

Where the host knew by the step (always on the CPU) the step reports at once. A skip the device
took is reported when the host learns of it: at the next step, zero_grad or scale_loss, or when
asked (`amp.last_overflow()`, `amp.state_dict()`); in a distributed run at the next step, so that
every rank reports at the same point (naming the parameters is a collective). Whether a step is
skipped is the optimizer's owner's to decide (optimizer.py).
"""

from .. import distributed
from .._state import amp_state, logger
from ..diagnostics import nonfinite_loss
from ..diagnostics.overflow import OverflowReport

__all__ = ["Skips"]


class Skips:
    """The skipped steps of one optimizer as the host learns of them. It is the origin watch's
    owner for that optimizer."""

    def __init__(self):
        self.waiting = []  # Checks the device decided on; to report once their copies arrive

    def skipped(self, checks, names):
        """This step is skipped: report it with `names`, the parameters whose gradients held
        inf/NaN (the step read the device: the copies have arrived)."""
        for check in checks:
            check.arrived(wait=True)
        self._learned(checks, names)

    def stepped(self, checks, known):
        """The step ran: checks the host knew are settled now, the others once they arrive."""
        if known:
            self._learned(checks, ())
        else:
            self.waiting.extend(checks)

    def poll(self, params, name_of, wait=False):
        """Report the skips the device decided on whose checks have arrived since (all, waiting
        for them, if `wait`), naming those of `params` (the optimizer's gradients of that step,
        if no zero_grad dropped them) whose gradients hold inf/NaN, by `name_of`. In a
        distributed run only at a step or when asked."""
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
                names = distributed.nonfinite_names(params, name_of)
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
            watch.arm(self)
