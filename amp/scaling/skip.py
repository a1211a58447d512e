"""Skipped steps: an optimizer's pending overflow flags, and the report of a step they skip."""

from .._state import amp_state, logger
from ..compat import distributed
from ..compat.optimizer_wrappers import wrapped_optimizers
from .overflow import OverflowReport


class SkipDecision:
    """The overflow flags of the scale_loss blocks since an optimizer's last step."""

    def __init__(self, record):
        self.record = record
        self.pending = []  # (loss_id, OverflowFlag) to read at the next step

    def add(self, loss_id, flag):
        self.pending.append((loss_id, flag))

    def clear(self):
        """zero_grad(): the gradients an overflow was found in are gone, so is the reason to skip."""
        self.pending = []

    def take(self):
        """The (loss_id, flag) pairs that overflowed since the last step (one sync per flag)."""
        pending, self.pending = self.pending, []
        return [(loss_id, flag) for loss_id, flag in pending if flag.is_set()]

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
        for loss_id, flag in overflowed:
            params = names
            previous = amp_state.last_overflow
            if previous is not None and previous.flag is flag:  # another optimizer of that loss
                params = previous.params + tuple(n for n in names if n not in previous.params)
            report = OverflowReport(loss_id, params, amp_state.loss_scalers[loss_id].loss_scale())
            report.flag = flag
            amp_state.last_overflow = report
            message = (
                f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale "
                f"to {report.loss_scale}"
            )
            if amp_state.verbosity >= 2:
                message += f"; non-finite gradients in: {', '.join(names) or 'none left'}"
            if amp_state.verbosity >= 1:
                logger.info(message)
