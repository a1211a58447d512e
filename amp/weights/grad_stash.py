"""The gradient stash of scale_loss: one discipline for every opt level, loss scale and nesting.

Each `scale_loss` block takes the gradients present when it opens (its frame), so that its
backward writes only its own gradients into `.grad`. When the block exits normally its gradients
are unscaled, checked for inf/NaN and joined with the ones taken (exactly: kept apart, added
after unscaling). When it raises, the taken gradients are put back and the block's own dropped:
an exception after backward leaves no trace.

Outside any block an optimizer's `.grad` are plain gradients, except after a block with
`delay_unscale=True`: they are then scaled by that block's scaler (`scaled_by`) and the unscaled
gradients from before are kept apart (`kept`) until a block without delay_unscale unscales the
scaled sum. A block continuing such an accumulation leaves the scaled sum in `.grad` for its
backward to add to (DDP all-reduces `.grad` as it is then), keeping a copy to put back if it
raises. A block nested in another on the same optimizer hands its unscaled gradients to the
enclosing block, which joins them if it exits normally itself.

O2: the master gradients are the unscaled store, held by the optimizer's owner (owner.py,
copies.py). New model gradients are unscaled into them (one kernel launch per dtype group) and
dropped from the model; a sparse model gradient gives a sparse master gradient. Where the owner
keeps them (amp's fused step, `owner.keep`), a block's fresh dense ones are only checked and kept
low precision for the step, which unscales them as it reads them: no FP32 master gradient is
made.

The stash is handed the parameters whose gradients a backward writes, or the plain ones (no
row), and reads the rows from the optimizer's owner.
"""

import functools
import itertools
import operator

import torch

from .. import distributed, kernels
from .columns import GRAD, IS_SPARSE, NONES, NOT_NONE, consume, repeat

__all__ = ["GradientStash"]


def _take(params):
    """[(param, grad)] for the params holding a gradient, which they no longer do."""
    grads = list(map(GRAD, params))
    if all(map(operator.is_, grads, NONES)):  # the usual case after zero_grad(set_to_none=True)
        return []
    taken = [(param, grad) for param, grad in zip(params, grads) if grad is not None]
    for param, _ in taken:
        param.grad = None
    return taken


def _unscalable(param, grad):
    """The tensor to unscale in place for `grad`: a sparse gradient's values (FP16 coalesced
    first, as torch.amp.GradScaler does: summing duplicate indices of scaled values could
    overflow), a complex gradient as its real view (the unscale kernels take real tensors)."""
    if grad.is_sparse:
        if grad.dtype is torch.float16:
            param.grad = grad = grad.coalesce()
        grad = grad._values()
    if grad.is_complex():
        grad = torch.view_as_real(grad)
    return grad


def _join(pairs):
    """param.grad = its current gradient + grad for each (param, grad), as autograd adds."""
    new, kept = [], []
    for param, grad in pairs:
        current = param.grad
        if current is None:
            param.grad = grad
        elif current.is_sparse or grad.is_sparse or current.dtype != grad.dtype:
            param.grad = current + grad
        else:
            new.append(current)
            kept.append(grad)
    if new:
        torch._foreach_add_(new, kept)  # new + kept == kept + new, bit for bit


class _Frame:
    __slots__ = ("scaler", "delay", "taken", "copies", "done", "inv", "identity")

    def __init__(self, scaler, delay, inv, identity, taken, copies=()):
        self.scaler = scaler  # the loss scaler, compared by identity only
        self.delay = delay
        self.inv = inv  # 1/scale the block's loss was scaled with (never written again)
        self.identity = identity  # a static scale of 1.0: nothing to unscale or check
        self.taken = taken  # the gradients present when the block opened, taken out of `.grad`
        self.copies = copies  # or, continuing an accumulation, copies of those left in `.grad`
        self.done = []  # unscaled (param, grad) from blocks nested in this one


class GradientStash:
    """The scale_loss frames of one optimizer, whose rows `owner` holds (None: no rows)."""

    def __init__(self, owner):
        self.owner = owner
        self.frames = []
        self.kept = []  # unscaled (param, grad) kept apart while `.grad` hold scaled ones
        self.scaled_by = None  # the LossScaler whose scale `.grad` hold, after delay_unscale

    def conflict(self, scaler, delay_unscale):
        """The scaler whose scaled gradients this block would have to add its own to, if it is
        not `scaler` (their sum would mix two scales); else None. Changes nothing."""
        if self.frames:
            theirs = self.frames[-1].scaler if delay_unscale else None
        else:
            theirs = self.scaled_by
        return theirs if theirs is not None and theirs is not scaler else None

    def enter(self, scaler, delay_unscale, inv_scale, identity, holders):
        """A block opens: its loss is scaled by `scaler`, whose 1/scale is `inv_scale` (a tensor
        on the loss's device, which no update writes). `holders`: the tensors whose `.grad` a
        backward of the optimizer's loss writes (OptimizerRecord.grad_holders)."""
        if not self.frames and self.scaled_by is scaler:
            # Continuing an accumulation: the scaled sum stays in `.grad` for backward to add to,
            # as autograd does and as DDP's reducer needs (after no_sync() micro-batches it
            # all-reduces the whole `.grad`); a copy puts it back if the block raises.
            copies = [(param, param.grad.clone()) for param in holders if param.grad is not None]
            self.frames.append(_Frame(scaler, delay_unscale, inv_scale, identity, [], copies))
            return
        taken = _take(holders)
        self.frames.append(_Frame(scaler, delay_unscale, inv_scale, identity, taken))

    def discard(self, holders):
        """The block raised: the gradients are put back as they were when it opened."""
        frame = self.frames.pop()
        for param in holders:
            param.grad = None
        for param, grad in frame.taken or frame.copies:
            param.grad = grad

    def commit(self, found_inf, plain, sharded=False):
        """The block exited normally: join its gradients with the ones taken (see module doc).
        Gradients unscaled here are checked for inf/NaN into `found_inf` (a float32 flag).
        `plain`: the optimizer's parameters without a row; `sharded`: some are DTensors (FSDP2),
        unscaled through their local shards. New master gradients are kept low precision where
        the owner keeps them and they can be (fresh and dense)."""
        self.sharded = sharded
        frame = self.frames.pop()
        nested = bool(self.frames)
        taken_scaled = nested or self.scaled_by is not None
        if frame.delay:
            if taken_scaled:
                _join(frame.taken)
            else:
                self.kept, self.scaled_by = frame.taken, frame.scaler
            (self.frames[-1].done if nested else self.kept).extend(frame.done)
            return
        if nested:
            self.frames[-1].done.extend(frame.done)
            self.frames[-1].done.extend(self._unscale(frame, found_inf, plain, False, False))
            _join(frame.taken)  # the enclosing block's own (still scaled) gradients
            return
        if taken_scaled:
            _join(frame.taken)  # the scaled sum of an accumulation, unscaled at once
            extras = self.kept + frame.done
            self.kept, self.scaled_by = [], None
        else:
            extras = frame.taken + frame.done
        if not extras:
            self._unscale(frame, found_inf, plain, True, True)
            return
        owner = self.owner
        index = {} if owner is None else owner.index
        for param, grad in extras:  # already unscaled: into the masters first (as apex's order)
            row = index.get(id(param))
            if row is not None:
                _add_to_master_grad(owner, row, grad.float())
        self._unscale(frame, found_inf, plain, False, True)
        _join([(param, grad) for param, grad in extras if id(param) not in index])

    def reset(self):
        """zero_grad(): the gradients kept apart, and those open blocks took when they opened,
        go with the ones in `.grad` (a block would otherwise add them back on exit)."""
        self.kept, self.scaled_by = [], None
        for frame in self.frames:
            frame.taken, frame.copies, frame.done = [], (), []

    def holds(self, scaler):
        """Whether gradients scaled by `scaler` wait here to be unscaled (an open block, or an
        accumulation of delay_unscale blocks)."""
        return self.scaled_by is scaler or any(frame.scaler is scaler for frame in self.frames)

    def adopt_model_grads(self):
        """Before a step: gradients of model parameters made by a backward outside scale_loss
        join the master gradients unscaled (apex dropped them; without this O2 would not
        step). A bf16 model's `.grad` is its gradient as it is: nothing to adopt."""
        owner = self.owner
        if owner.grads_in_model or all(map(operator.is_, map(GRAD, owner.params), NONES)):
            return
        owner.materialize()
        for row, param in enumerate(owner.params):
            grad = param.grad
            if grad is not None:
                _add_to_master_grad(owner, row, grad.float())
                param.grad = None

    def _unscale(self, frame, found_inf, params, keep, into_masters):
        """Unscale and check the gradients in `.grad` by `frame`'s scale. into_masters: O2 model
        gradients go into the master gradients (or, `keep`, kept by the owner), plain ones stay
        in `.grad`; else every unscaled gradient is taken out of `.grad` and returned as (param,
        grad), for the enclosing block."""
        owner = self.owner
        inv_scale = frame.inv
        grads = [*filter(NOT_NONE, map(GRAD, params))] if params else ()
        views = ()
        if grads and not frame.identity:
            views = grads
            # C-level checks per gradient (a generator costs a Python frame per parameter).
            if any(map(IS_SPARSE, grads)) or any(map(torch.is_complex, grads)):
                views = [_unscalable(p, p.grad) for p in params if p.grad is not None]
            if self.sharded:
                views = distributed.local_tensors(views)
        handed = [] if into_masters or not params else _take(params)  # unscaled in place below
        if owner is None or not owner.params:
            kernels.unscale_(views, inv_scale, found_inf)
        else:  # with the model gradients, in one launch where it can
            _unscale_model_grads(owner, inv_scale, found_inf, into_masters, handed, views, keep)
        return handed


def _unscale_model_grads(owner, inv_scale, found_inf, into_masters, handed, plain, keep):
    """O2: the model gradients, unscaled and checked, into FP32 gradients: the master gradients
    (into_masters; added to those there), else (model param, FP32 gradient) into `handed`. Fresh
    dense ones (`keep`) stay where the owner has them: in the model's `.grad`, unscaled in place
    (a bf16 model's), or kept low precision and scaled for the step; else the model's gradients
    are dropped (a bf16 model's `.grad` then holds its FP32 master gradients' rounding). The
    `plain` gradients are unscaled in place and checked, with the new master gradients where
    those are made."""
    models = owner.params
    grads = list(map(GRAD, models))
    rows = range(len(models))
    # Identity tests at C level: `None in grads` would compare each tensor with ==, 20 us each.
    present = list(map(operator.is_not, grads, NONES))
    if not all(present):
        if not any(present):
            kernels.unscale_(plain, inv_scale, found_inf)
            return
        models = list(itertools.compress(models, present))  # parameters that had no gradient
        rows = list(itertools.compress(rows, present))  # (unused in this backward)
        grads = list(itertools.compress(grads, present))
    dense = not any(map(IS_SPARSE, grads))
    # StateOwner's, with no FP32 master gradient: the usual O2 bf16 exit
    if into_masters and keep and dense and owner.grads_in_model and not owner.grads:
        views = _local(owner, grads)
        kernels.unscale_([*plain, *views] if plain else views, inv_scale, found_inf)
        return
    if into_masters:
        all_grads = owner.master_grads()
        master_grads = [all_grads[row] for row in rows]
    else:
        master_grads = [None]
    fresh_ones = all(map(operator.is_, master_grads, NONES))
    consume(map(setattr, models, repeat("grad"), NONES))
    if not fresh_ones or not dense:
        kernels.unscale_(plain, inv_scale, found_inf)
        if (
            not dense
            or any(map(operator.is_, master_grads, NONES))  # some master gradients only
            or any(map(IS_SPARSE, master_grads))
        ):
            _unscale_one_by_one(owner, models, rows, grads, inv_scale, found_inf, into_masters,
                                handed)
        else:  # into the master gradients there, one launch per dtype group
            kernels.unscale_add_(
                _local(owner, grads), _local(owner, master_grads), inv_scale, found_inf,
                check=False,
            )
        if into_masters:
            owner.place_copies(list(rows))
        return
    if into_masters and keep and owner.keeps_on(grads[0].device):
        kernels.unscale_(plain, inv_scale, found_inf)
        kernels.check_(_local(owner, grads), found_inf)
        owner.keep(list(rows), grads, inv_scale)
        return
    # One launch per dtype group and piece (per launch-sized run of tensors with the CuPy
    # kernels); each piece's low-precision gradients are let go before the next is made.
    rows = list(rows)
    for start, stop in _pieces(models):
        fresh = list(map(_EMPTY_FP32, models[start:stop]))
        kernels.unscale_to_(
            _local(owner, grads[start:stop]), _local(owner, fresh), inv_scale, found_inf,
            check=False, also=plain,
        )
        grads[start:stop] = [None] * (stop - start)
        plain = ()
        if into_masters:
            owner.set_master_grads(rows[start:stop], fresh)
        else:
            handed.extend(zip(models[start:stop], fresh))
    if into_masters:
        owner.place_copies(rows)


_EMPTY_FP32 = functools.partial(torch.empty_like, dtype=torch.float32)


def _local(owner, tensors):
    """`tensors` as the kernels take them: FSDP2's DTensors (an owner's sharded rows) as their
    local shards, which the kernels read and write elementwise."""
    return distributed.shards(tensors) if owner.sharded else tensors


# FP32 gradients made from low-precision ones at once: a quarter of them. All at once, the model's
# gradients and all the new ones are held together (6 bytes a parameter with bf16, the step's
# peak); in quarters, the peak is 4.5 bytes over what the masters hold.
_PIECES = 4
_WHOLE = 1 << 22  # elements: up to this, one piece (one launch, as a hand-written O2 makes)


def _pieces(models):
    """(start, stop) runs of `models` of about 1/_PIECES of their elements each."""
    numels = list(map(torch.Tensor.numel, models))
    total = sum(numels)
    if total <= _WHOLE:
        return [(0, len(models))]
    bound, runs, start, size = total / _PIECES, [], 0, 0
    for index, numel in enumerate(numels):
        size += numel
        if size >= bound:
            runs.append((start, index + 1))
            start, size = index + 1, 0
    if start < len(numels):
        runs.append((start, len(numels)))
    return runs


def _unscale_one_by_one(owner, models, rows, grads, inv_scale, found_inf, into_masters, handed):
    """_unscale_model_grads for a mix of sparse and dense gradients, or of master gradients."""
    fresh_sources, fresh, add_sources, add_to, later = [], [], [], [], []
    master_grads = owner.master_grads()
    for model_param, row, grad in zip(models, rows, grads):
        if grad.is_sparse:
            grad = grad.coalesce()
            values = torch.empty_like(grad._values(), dtype=torch.float32)
            kernels.unscale_to_([grad._values()], [values], inv_scale, found_inf)
            unscaled = torch.sparse_coo_tensor(
                grad._indices(), values, grad.shape, is_coalesced=True, check_invariants=False
            )
            if into_masters:
                _add_to_master_grad(owner, row, unscaled)
            else:
                handed.append((model_param, unscaled))
        elif into_masters and master_grads[row] is not None and not master_grads[row].is_sparse:
            add_sources.append(grad)
            add_to.append(master_grads[row])
        else:
            destination = torch.empty_like(model_param, dtype=torch.float32)
            fresh_sources.append(grad)
            fresh.append(destination)
            if not into_masters:
                handed.append((model_param, destination))
            else:
                later.append((row, destination))
    local = functools.partial(_local, owner)
    kernels.unscale_to_(local(fresh_sources), local(fresh), inv_scale, found_inf, check=False)
    kernels.unscale_add_(local(add_sources), local(add_to), inv_scale, found_inf, check=False)
    for row, grad in later:
        _add_to_master_grad(owner, row, grad)


def _add_to_master_grad(owner, row, grad):
    """The row's master gradient += grad (FP32), a sparse gradient kept sparse (SparseAdam
    needs it)."""
    current = owner.master_grads()[row]
    if current is None:
        owner.set_master_grads([row], [grad])
    elif current.is_sparse or grad.is_sparse:
        owner.set_master_grads([row], [current + grad])
    else:
        current.add_(grad)
