"""The torch backend's fused steps over the compact forms of the state (`_codecs.py`): a master
held as its bf16 weight and an int16 remainder (exact) or an int8 correction, moments held in
8 bits (codes and block scales) or in bf16.

An exact master with FP32 moments is stepped whole: the rows' values decoded into FP32 tensors
of their weights' shapes, torch's own fused op on them as on FP32 masters, and encoded back. So
its numbers are torch's fused step's on the same tensors, bit for bit whatever the thread count
(torch's CPU op rounds the tail of each thread's range apart from its vector body, and pieces
would move those tails). Rows are stepped a run of at most WHOLE elements at a time.

Every other row is stepped in pieces of at most PIECE elements (a multiple of the moments'
block): the piece's master, moments and unscaled gradient are made FP32, torch's own fused op
steps them, and they are written back in their forms. The FP32 temporaries of one piece are all
the step holds beyond the state, so its peak does not grow with the model. Where the overflow flag
is set, torch's op changes nothing and every form written back is selected from before (not
encoded again: an inf weight's correction, a NaN's payload, a low copy another writer made stay
as they were), so a skipped step changes no bit.
"""

import itertools
import operator

import torch

from . import _codecs

__all__ = ["PIECE", "WHOLE", "adam_step_", "sgd_step_"]

PIECE = 1 << 20  # elements per piece: 4 MiB a FP32 temporary
ALL = slice(None)  # _whole_rows' answer where every row is stepped whole
WHOLE = PIECE  # elements per run of rows stepped whole (a larger tensor alone, decoded in pieces)
_dtype = operator.attrgetter("dtype")
_numel = torch.Tensor.numel
_contiguous = torch.Tensor.is_contiguous
_flatten = torch.Tensor.flatten
repeat = itertools.repeat


def _whole_rows(masters, moments, scales):
    """Indices of the rows stepped whole (an int16 remainder, FP32 moments) and of the others."""
    remainders = list(map(operator.is_, map(_dtype, masters), repeat(torch.int16)))
    if scales is None:
        fp32 = [map(operator.is_, map(_dtype, m), repeat(torch.float32)) for m in moments if m]
        whole = list(map(all, zip(remainders, *fp32)))
    else:
        whole = [False] * len(masters)
    if all(whole):
        return ALL, []
    return [i for i, w in enumerate(whole) if w], [i for i, w in enumerate(whole) if not w]


def _pick(values, indices):
    """values[indices]; the lists themselves where `indices` is all of them (ALL)."""
    if values is None or indices is ALL:
        return values
    return [values[i] for i in indices]


def _runs(indices, numels):
    """`indices` (or ALL) in runs of at most WHOLE elements (a larger tensor alone)."""
    if indices is ALL:
        if sum(numels) <= WHOLE:
            return [ALL]
        indices = range(len(numels))
    if not indices:
        return []
    runs, run, size = [], [], 0
    for i in indices:
        if run and size + numels[i] > WHOLE:
            runs.append(run)
            run, size = [], 0
        run.append(i)
        size += numels[i]
    if run:
        runs.append(run)
    return runs


def adam_step_(
    grads, lows, masters, exp_avgs, exp_avg_sqs, steps, scales, inv_scale, found_inf, options,
    starts=None,
):
    """kernels.adam_step_ over rows with compact masters (an int16 remainder or an int8
    correction of the bf16 `lows`) and/or encoded moments (`scales`: the two moments' block
    scales for 8-bit codes; bf16 moments need none); `starts`: each row's first element in its
    whole tensor (None: 0), where the second moment's dither begins."""
    whole, pieces = _whole_rows(masters, (exp_avgs, exp_avg_sqs), scales)
    torch._foreach_add_(steps, 1)
    step = options.fused_op()
    kwargs = options.fused_kwargs(found_inf)
    numels = list(map(_numel, grads))
    for run in _runs(whole, numels):
        values = _Whole(_pick(lows, run), _pick(masters, run))
        step(
            values.fp32,
            _unscaled_whole(_pick(grads, run), inv_scale),
            _pick(exp_avgs, run),
            _pick(exp_avg_sqs, run),
            [],
            _pick(steps, run),
            **kwargs,
        )
        values.write_back()
    m_scales, v_scales = scales if scales is not None else (None, None)
    for i in pieces:
        grad = grads[i]
        for piece in _pieces(grad):
            master = _Master(masters[i], None if lows is None else lows[i], piece)
            m = _Moment(exp_avgs[i], None if m_scales is None else m_scales[i], True, piece)
            v = _Moment(exp_avg_sqs[i], None if v_scales is None else v_scales[i], False, piece)
            v.step = steps[i]  # its codes are rounded stochastically (_codecs.dither_bits)
            v.start = 0 if starts is None else starts[i]
            step(
                [master.fp32],
                [_unscaled(grad, piece, inv_scale)],
                [m.fp32],
                [v.fp32],
                [],
                [steps[i]],
                **kwargs,
            )
            master.write_back(found_inf)
            m.write_back(found_inf)
            v.write_back(found_inf)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


def sgd_step_(grads, lows, masters, buffers, scales, inv_scale, found_inf, options, first_step):
    """kernels.sgd_step_ over rows with compact masters and/or encoded momentum buffers (`scales`
    their block scales for 8-bit codes); `first_step`: the buffers start as the gradients
    (torch's first step)."""
    momentum = options.momentum != 0
    whole, pieces = _whole_rows(masters, (buffers if momentum else None,), scales)
    kwargs = options.fused_kwargs(found_inf, first_step)
    numels = list(map(_numel, grads))
    for run in _runs(whole, numels):
        values = _Whole(_pick(lows, run), _pick(masters, run))
        torch._fused_sgd_(
            values.fp32,
            _unscaled_whole(_pick(grads, run), inv_scale),
            _pick(buffers, run) if momentum else [],
            **kwargs,
        )
        values.write_back()
    for i in pieces:
        grad = grads[i]
        for piece in _pieces(grad):
            master = _Master(masters[i], None if lows is None else lows[i], piece)
            buffer = None
            if momentum:
                buffer = _Moment(buffers[i], None if scales is None else scales[i], True, piece)
            torch._fused_sgd_(
                [master.fp32],
                [_unscaled(grad, piece, inv_scale)],
                [] if buffer is None else [buffer.fp32],
                **kwargs,
            )
            master.write_back(found_inf)
            if buffer is not None:
                buffer.write_back(found_inf)


def _pieces(tensor):
    numel = tensor.numel()
    return [slice(start, min(start + PIECE, numel)) for start in range(0, numel, PIECE)]


def _flat(tensor):
    """`tensor` as a flat view (a copy for one that is not contiguous: written back whole)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


def _unscaled(grad, piece, inv_scale):
    """The piece of `grad` in FP32, times `inv_scale` (one rounding in float32)."""
    values = _flat(grad)[piece].to(torch.float32, copy=True)  # a copy: the gradient stays
    return values if inv_scale is None else values.mul_(inv_scale)


def _unscaled_whole(grads, inv_scale):
    """The gradients in FP32, each in its own layout, times `inv_scale` (one rounding)."""
    if inv_scale is None and all(map(operator.is_, map(_dtype, grads), repeat(torch.float32))):
        return grads
    copies = [torch.empty_like(grad, dtype=torch.float32) for grad in grads]
    torch._foreach_copy_(copies, grads)  # exact
    if inv_scale is not None:
        torch._foreach_mul_(copies, inv_scale)
    return copies


class _Whole:
    """The FP32 values of exact masters (bf16 weights, int16 remainders), each an FP32 tensor in
    its weight's layout (torch's fused op walks all of a row's tensors in memory order), and
    their write-back. Re-encoding what was decoded gives the same bits, so where the overflow
    flag left the values as they were nothing changes. Contiguous rows are decoded and encoded
    in one buffer; a contiguous tensor larger than a piece (alone in its run) a piece at a time,
    so that the codecs' temporaries stay a piece's (the FP32 values and gradients the fused op
    takes are the run's)."""

    def __init__(self, lows, remainders):
        self.lows, self.remainders = lows, remainders
        self.buffer, self.pieces = None, None
        contiguous = all(map(_contiguous, lows)) and all(map(_contiguous, remainders))
        if contiguous and len(lows) == 1 and lows[0].numel() > PIECE:
            low, rest = lows[0].view(-1), remainders[0].view(-1)
            value = torch.empty_like(lows[0], dtype=torch.float32)
            self.fp32, self.pieces = [value], _pieces(low)
            for piece in self.pieces:
                value.view(-1)[piece] = _codecs.remainder_decode(low[piece], rest[piece])
        elif contiguous:
            self.flat_lows = list(map(_flatten, lows))
            self.flat_remainders = list(map(_flatten, remainders))
            self.numels = list(map(_numel, lows))
            self.buffer = _codecs.remainder_decode(
                torch.cat(self.flat_lows), torch.cat(self.flat_remainders)
            )
            parts = torch.split_with_sizes(self.buffer, self.numels)
            self.fp32 = list(map(torch.Tensor.view_as, parts, lows))
        else:
            self.fp32 = [torch.empty_like(low, dtype=torch.float32) for low in lows]
            for value, low, rem in zip(self.fp32, lows, remainders):
                value.copy_(_codecs.remainder_decode(low, rem).view(low.shape))

    def write_back(self):
        if self.pieces is not None:
            value, low = self.fp32[0].view(-1), self.lows[0].view(-1)
            rest = self.remainders[0].view(-1)
            for piece in self.pieces:
                weights, rests = _codecs.remainder_encode(value[piece])
                low[piece].copy_(weights)
                rest[piece].copy_(rests)
            return
        if self.buffer is not None:
            weights, rests = _codecs.remainder_encode(self.buffer)
            torch._foreach_copy_(self.flat_lows, torch.split_with_sizes(weights, self.numels))
            torch._foreach_copy_(self.flat_remainders, torch.split_with_sizes(rests, self.numels))
            return
        for value, low, rem in zip(self.fp32, self.lows, self.remainders):
            weight, rest = _codecs.remainder_encode(value)
            low.copy_(weight.view(low.shape))
            rem.copy_(rest.view(rem.shape))


def _write(tensor, piece, values, found_inf=None):
    """tensor.flat[piece] = values, for a contiguous tensor or one written back whole; where
    `found_inf` is set, the old values (a select: no sync)."""
    if found_inf is not None:
        values = torch.where(found_inf != 0, _flat(tensor)[piece], values)
    if tensor.is_contiguous():
        tensor.view(-1)[piece].copy_(values)
    else:
        flat = tensor.reshape(-1)
        flat[piece] = values
        tensor.copy_(flat.view(tensor.shape))


class _Master:
    """A piece of one master as FP32: a view of an FP32 master (stepped in place), or the decoded
    compact one (its int16 remainder or int8 correction of the bf16 `low`)."""

    def __init__(self, master, low, piece):
        self.master, self.low, self.piece = master, low, piece
        if master.dtype is torch.int16:
            self.fp32 = _codecs.remainder_decode(_flat(low)[piece], _flat(master)[piece])
        elif master.dtype is torch.int8:
            self.fp32 = _codecs.compact_decode(_flat(low)[piece], _flat(master)[piece])
        else:
            self.fp32 = _flat(master)[piece]

    def write_back(self, found_inf):
        """The stepped values into the master's forms (the old ones where `found_inf` is set)."""
        master, low, piece = self.master, self.low, self.piece
        if master.dtype.is_floating_point:
            if not master.is_contiguous():
                _write(master, piece, self.fp32)  # unchanged by a skipped step
            if low is not None:
                _write(low, piece, self.fp32.to(low.dtype), found_inf)
            return
        encode = _codecs.remainder_encode if master.dtype is torch.int16 else _codecs.compact_encode
        weight, rest = encode(self.fp32)
        _write(low, piece, weight, found_inf)
        _write(master, piece, rest, found_inf)


class _Moment:
    """A piece of one moment as FP32: a view of an FP32 moment, a bf16 moment upcast, or 8-bit
    codes and their block scales decoded (`signed`: softsign codes, else square-root codes)."""

    def __init__(self, held, scales, signed, piece):
        self.held, self.scales, self.signed, self.piece = held, scales, signed, piece
        self.step, self.start = None, 0  # a stochastic rounding's step; the row's first element
        flat = _flat(held)[piece]
        if held.dtype is torch.float32:
            self.fp32 = flat
        elif scales is None:
            self.fp32 = flat.float()
        else:
            blocks = slice(piece.start // _codecs.BLOCK, -(-piece.stop // _codecs.BLOCK))
            self.blocks = blocks
            decode = _codecs.signed_decode if signed else _codecs.unsigned_decode
            self.fp32 = decode(flat, scales[blocks])

    def write_back(self, found_inf):
        held, piece = self.held, self.piece
        if held.dtype is torch.float32:
            if not held.is_contiguous():  # stepped in a copy
                _write(held, piece, self.fp32)
            return
        if self.scales is None:  # bf16: a second moment rounded stochastically in a step
            if self.step is None:
                values = self.fp32.to(held.dtype)
            else:
                values = _codecs.bf16_stochastic(self.fp32, self.step, self.start + piece.start)
            _write(held, piece, values, found_inf)
            return
        if self.signed:
            codes, scales = _codecs.signed_encode(self.fp32)
        else:
            codes, scales = _codecs.unsigned_encode(self.fp32, self.step, self.start + piece.start)
        old_codes, old_scales = held.view(-1)[piece], self.scales[self.blocks]
        if found_inf is not None:  # a skipped step keeps the codes it had (no sync: a select)
            skipped = found_inf != 0
            codes = torch.where(skipped, old_codes, codes)
            scales = torch.where(skipped, old_scales, scales)
        old_codes.copy_(codes)
        old_scales.copy_(scales)
