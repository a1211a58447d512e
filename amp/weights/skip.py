"""Skipped steps: an optimizer's pending overflow flags, and the report of a step they skip."""

import torch

from .. import distributed
from .._state import amp_state, logger
from ..apex_interop.optimizer_wrappers import wrapped_optimizers
from ..diagnostics import nonfinite_loss
from ..diagnostics.overflow import OverflowReport


class OverflowFlag:
    """A float32 device flag set by the unscale kernels; read (one sync) at most once."""

    __slots__ = ("tensor", "_value")

    def __init__(self, device):
        self.tensor = torch.zeros((), dtype=torch.float32, device=device)
        self._value = None

    def is_set(self):
        if self._value is None:
            self._value = bool(self.tensor.item())
        return self._value


class SkipDecision:
    """The overflow flags of the scale_loss blocks since an optimizer's last step."""

    def __init__(self, record):
        self.record = record
        # (loss_id, OverflowFlag, loss-finite device flag or None, its loss scaler), appended
        # by scale_loss's exit; zero_grad() empties it (the gradients an overflow was found in are gone, and so
        # is the reason to skip). Both touch the list directly: they run every step.
        self.pending = []

    def take(self):
        """The pending entries that overflowed since the last step (one sync per flag).

        A watched step (the one after a skip) ends here: its hooks go and its origin is found.
        """
        watch = amp_state.origin_watch
        if watch.armed:
            watch.settle(self.record, [entry[1] for entry in self.pending])
        pending, self.pending = self.pending, []
        overflowed = []  # a loop, not a comprehension: no Python frame of its own
        for entry in pending:
            if entry[1].is_set():
                overflowed.append(entry)
        if pending and not overflowed and amp_state.nonfinite_loss_run is not None:
            nonfinite_loss.after_clean_step()
        return overflowed

    def skip(self, overflowed):
        """Skip this step: report where the overflow came from and drop the master gradients."""
        record = self.record
        # The user did call step(): an LR scheduler made before amp.initialize, or one on the
        # torch optimizer a wrapper holds (LARC), must not warn that its step() came first.
        if getattr(record.originals["step"], "_wrapped_by_lr_sched", False):
            record.optimizer._opt_called = True
        for inner in wrapped_optimizers(record.optimizer):
            if getattr(inner.step, "_wrapped_by_lr_sched", False):
                inner._opt_called = True
        params = record.plain_params() + [master for _, master in record.master_pairs]
        names = distributed.nonfinite_names(params, record.param_name)
        for _, master in record.master_pairs:
            master.grad = None
        watch = amp_state.origin_watch
        bad_loss = fresh = False
        for loss_id, flag, loss_ok, scaler in overflowed:
            origin = watch.origin_for(flag)
            loss_finite = loss_ok is None or bool(loss_ok.item())  # the step syncs anyway
            params = names
            previous = amp_state.last_overflow
            again = previous is not None and previous.flag is flag  # another optimizer of it
            if again:
                params = previous.params + tuple(n for n in names if n not in previous.params)
            report = OverflowReport(
                loss_id,
                params,
                scaler.loss_scale(),
                origin=origin,
                nonfinite_loss=not loss_finite,
            )
            report.flag = flag
            amp_state.last_overflow = report
            if loss_finite:
                message = (
                    f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss "
                    f"scale to {report.loss_scale}"
                )
            else:
                # apex's words first: scripts count skipped steps by them
                message = (
                    f"Gradient overflow.  Skipping step, loss scaler {loss_id} keeping loss scale "
                    f"at {report.loss_scale}: the loss itself is inf or NaN"
                )
            if not again:  # the first optimizer of that loss speaks for the run of bad losses
                fresh = True
                if not loss_finite:
                    bad_loss = True
                    nonfinite_loss.after_bad_loss(loss_id, origin, watch.watched(flag))
            if amp_state.verbosity >= 2:
                message += f"; non-finite gradients in: {', '.join(names) or 'none left'}"
            if amp_state.verbosity >= 1:
                if origin is not None:
                    message += f"; it started in {origin}"
                logger.info(message)
        if fresh and not bad_loss:
            nonfinite_loss.after_clean_step()
        watch.arm(record)
