"""amp's loss scale and skipped steps in the Trainer's logs (``AmpPrecision(log=True)``).

Learning them makes the host wait for the device, so they are logged only at the steps the
Trainer writes its logs at (``log_every_n_steps``) and at the last step of each epoch and of the
run, where a step between them waits for nothing.
"""

from typing import Any

import amp

from .skips import SkipCount

__all__ = ["log_step"]


def log_step(model: Any, skips: SkipCount) -> None:
    """Log ``amp/loss_scale`` and ``amp/skipped_steps`` through the LightningModule `model`
    after an optimizer step, if the Trainer writes its logs at this one."""
    if not _writes_logs_now(model.trainer):
        return
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]  # waits for the copies
    model.log("amp/loss_scale", float(scale), on_step=True, on_epoch=False)
    model.log("amp/skipped_steps", float(skips.skipped), on_step=True, on_epoch=False)


def _writes_logs_now(trainer: Any) -> bool:
    """Whether this optimizer step is one the Trainer writes its logs at (``log_every_n_steps``),
    or the last of its epoch or of the run."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is None or connector.should_update_logs:
        return True
    if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        return True
    return 0 <= trainer.max_steps <= trainer.global_step + 1
