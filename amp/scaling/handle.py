"""scale_loss: scale a loss for backward, then unscale, check and (on overflow) skip."""

import contextlib


from .._state import amp_state
from ..compat.optimizer_wrappers import is_optimizer_like
from . import nonfinite_loss
from .scaler import OverflowFlag


def _records(optimizers):
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


@contextlib.contextmanager
def scale_loss(
    loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False
):
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
    if not amp_state.initialized:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
            "before `with amp.scale_loss`."
        )
    if not amp_state.enabled:
        yield loss
        return
    records = _records(optimizers)
    if (
        isinstance(loss_id, bool)
        or not isinstance(loss_id, int)
        or not (0 <= loss_id < len(amp_state.loss_scalers))
    ):
        raise ValueError(
            f"amp.scale_loss: loss_id={loss_id!r} is out of range; amp.initialize was called "
            f"with num_losses={len(amp_state.loss_scalers)}, so use 0 to "
            f"{len(amp_state.loss_scalers) - 1}."
        )
    scaler = amp_state.loss_scalers[loss_id]
    for record in records:
        theirs = record.stash.conflict(scaler, delay_unscale)
        if theirs is not None:
            raise RuntimeError(
                f"amp.scale_loss(loss_id={loss_id}): the gradients of this optimizer are scaled "
                f"by loss scaler {amp_state.loss_scalers.index(theirs)} (an enclosing block, or "
                "a block with delay_unscale=True), and the sum of gradients scaled by two "
                "different scales cannot be unscaled. Accumulate with one loss_id, or unscale "
                "(a block with delay_unscale=False) before changing it."
            )
    # The forward pass is over. Autograd keeps the weight casts its backward needs and frees each
    # as soon as it has been used; the cache holding them all through backward would only raise
    # the peak memory (and slow the backward's allocations).
    amp_state.cast_cache.clear()
    loss_ok = nonfinite_loss.check(
        loss, scaler.dynamic and not (delay_unscale or delay_overflow_check)
    )
    entered = []
    try:
        try:
            for record in records:
                record.stash.enter(scaler, delay_unscale)
                entered.append(record)
            yield scaler.scale(loss)
        except BaseException:
            for record in entered:
                record.stash.discard()
            raise
        flag = None if delay_unscale else OverflowFlag(loss.device)
        for record in records:
            record.stash.commit(flag)
        if not delay_unscale:
            scaler.count_pass()  # apex's static `_unskipped` (amp._amp_state)
        if delay_unscale or not scaler.dynamic or delay_overflow_check:
            return
        # Every rank takes the same skip decision, even when only one saw the overflow.
        loss_ok = nonfinite_loss.agree(flag, loss_ok)
        for record in amp_state.optimizers:  # blocks still open keep the scale they used
            record.stash.freeze_scale(scaler, flag.tensor.device)
        nonfinite_loss.update(scaler, flag, loss_ok)
        for record in records:
            record.skips.add(loss_id, flag, loss_ok)
    finally:
        amp_state.cast_cache.clear()
