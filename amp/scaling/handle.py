"""scale_loss: scale a loss for backward, then unscale, check and (on overflow) skip."""

import contextlib
from typing import Any

import torch

from .._state import amp_state
from ..apex_interop.optimizer_wrappers import is_optimizer_like

__all__ = ["scale_loss"]


def _checked_records(optimizers):
    if is_optimizer_like(optimizers):
        optimizers = [optimizers]
    elif not isinstance(optimizers, (list, tuple)):
        raise TypeError(
            "amp.scale_loss: optimizers must be an optimizer or a list of optimizers returned "
            f"by amp.initialize; got {type(optimizers).__name__}."
        )
    if not optimizers:
        raise ValueError(
            "amp.scale_loss: optimizers is empty, so no gradient would be unscaled and the next "
            "step() would apply scaled gradients. Pass the optimizer(s) owning the parameters "
            "of this loss."
        )
    records, seen = [], set()
    for optimizer in optimizers:
        record = vars(optimizer).get("_amp_record") if hasattr(optimizer, "__dict__") else None
        if record is None:
            raise TypeError(
                f"amp.scale_loss: {type(optimizer).__name__} was not passed to amp.initialize; "
                "pass every optimizer that owns parameters of this loss to amp.initialize."
            )
        if id(record) not in seen:
            seen.add(id(record))
            records.append(record)
    return records


def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: torch.nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """Scale `loss` for backward; on exit unscale the new gradients and check them.

    Yields ``loss.float() * loss_scale``. On exit the gradients this backward produced are
    unscaled in place (O2: into the FP32 master gradients), gradients accumulated earlier are
    kept apart meanwhile and added back afterwards, and the new ones are checked for inf/NaN. An
    overflow makes the next ``step()`` of every optimizer passed here a no-op and halves the
    loss scale. If the block raises, gradients are put back as they were when it opened, at
    every opt level, with delay_unscale and in nested blocks.

    Args:
        loss (Tensor): the loss.
        optimizers: the optimizer (or list of optimizers) owning the parameters that receive
            gradients from this loss.
        loss_id (int, optional, default=0): which loss scaler to use, below `num_losses`.
        model: unused (reserved, as in apex).
        delay_unscale (bool, optional, default=False): leave the gradients scaled, to be
            unscaled by a later `scale_loss` before `step()` (gradient accumulation).
        delay_overflow_check (bool, optional, default=False): unscale, but neither check for
            overflow nor change the scale.

    Example::

        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    .. note:: The overflow flag stays on the device; the only host sync is at ``step()``.
    """
    return _ScaleLoss(loss, optimizers, loss_id, delay_unscale, delay_overflow_check)


class _ScaleLoss:
    """The block of one scale_loss. A class rather than a generator context manager: it runs
    every step, and contextlib's machinery would add Python calls to each."""

    __slots__ = (
        "loss",
        "optimizers",
        "loss_id",
        "delay_unscale",
        "delay_overflow_check",
        "records",
        "scaler",
    )

    def __init__(self, loss, optimizers, loss_id, delay_unscale, delay_overflow_check):
        self.loss = loss
        self.optimizers = optimizers
        self.loss_id = loss_id
        self.delay_unscale = delay_unscale
        self.delay_overflow_check = delay_overflow_check
        self.records = None  # None: amp is disabled, the loss goes through as it is

    def __enter__(self):
        if not amp_state.initialized:
            raise RuntimeError(
                "Invoked `with amp.scale_loss`, but internal Amp state has not been initialized.  "
                "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be "
                "called before `with amp.scale_loss`."
            )
        if not amp_state.enabled:
            return self.loss
        # The usual call, one optimizer amp instrumented, costs one dict lookup.
        try:
            record = self.optimizers.__dict__.get("_amp_record")
        except AttributeError:  # a list or tuple of optimizers
            record = None
        records = (record,) if record is not None else _checked_records(self.optimizers)
        loss_id = self.loss_id
        scalers = amp_state.loss_scalers
        try:
            if (
                not (
                    type(loss_id) is int
                    or (isinstance(loss_id, int) and not isinstance(loss_id, bool))
                )
                or loss_id < 0
            ):
                raise IndexError
            scaler = scalers[loss_id]
        except IndexError:
            raise ValueError(
                f"amp.scale_loss: loss_id={loss_id!r} is out of range; amp.initialize was called "
                f"with num_losses={len(scalers)}, so use 0 to {len(scalers) - 1}."
            ) from None
        # The forward pass is over. Autograd keeps the weight casts its backward needs and frees
        # each as soon as it has been used; the cache holding them all through backward would
        # only raise the peak memory (and slow the backward's allocations).
        if amp_state.cast_cache.filled:
            amp_state.cast_cache.clear()
        if amp_state.origin_watch.armed:
            amp_state.origin_watch.note_loss(self.loss)
        delay_unscale = self.delay_unscale
        entered = []
        try:
            inv_scale = scaler.inv_scale(self.loss.device)
            scaled = scaler.scale(self.loss)
            for record in records:
                theirs = record.open_block(scaler, delay_unscale, inv_scale, scaler.is_identity)
                if theirs is not None:
                    raise RuntimeError(
                        f"amp.scale_loss(loss_id={loss_id}): the gradients of this optimizer are "
                        f"scaled by loss scaler {scalers.index(theirs)} (an enclosing block, or a "
                        "block with delay_unscale=True), and the sum of gradients scaled by two "
                        "different scales cannot be unscaled. Accumulate with one loss_id, or "
                        "unscale (a block with delay_unscale=False) before changing it."
                    )
                entered.append(record)
        except BaseException:
            for record in entered:
                record.drop_block()
            amp_state.cast_cache.clear()
            raise
        self.records, self.scaler = records, scaler
        return scaled

    def __exit__(self, exc_type, exc_value, traceback):
        records = self.records
        if records is None:
            return False
        self.records = None  # a block is left once
        try:
            if exc_type is not None:
                for record in records:
                    record.drop_block()
                return False
            # The block exited normally: unscale, check, and let the scale follow.
            scaler = self.scaler
            delay_unscale = self.delay_unscale
            checked = scaler.dynamic and not (delay_unscale or self.delay_overflow_check)
            device = self.loss.device
            check = None
            if delay_unscale:
                found = None
            elif checked:
                check = scaler.open_check(self.loss_id, device)
                found = check.found
            else:
                found = scaler.scratch_flag(device)  # static scales never skip
            unscaled = set() if len(records) > 1 else None  # shared parameters: once
            for record in records:
                record.close_block(found, check, unscaled)
            if not delay_unscale and not scaler.dynamic:
                scaler.count_pass()  # apex's static `_unskipped` (amp._amp_state)
            if checked:
                # Every rank takes the same skip decision, even when only one saw the overflow.
                scaler.update(check, self.loss)
            return False
        finally:
            if amp_state.cast_cache.filled:
                amp_state.cast_cache.clear()
