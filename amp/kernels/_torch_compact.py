"""The torch backend's fused steps over compact state (`_codecs.py`): a master held as its bf16
weight and an int8 correction, moments held in 8 bits (codes and block scales) or in bf16.

Each tensor is stepped in pieces of at most PIECE elements (a multiple of the moments' block):
the piece's master, moments and unscaled gradient are made FP32, torch's own fused op steps
them, and they are written back in their compact forms. The FP32 temporaries of one piece are
all the step holds beyond the state, so its peak does not grow with the model. Where the
overflow flag is set, torch's op changes nothing and every form written back is selected from
before (not encoded again: an inf weight's correction, a NaN's payload, a low copy another
writer made stay as they were), so a skipped step changes no bit.
"""

import torch

from . import _codecs

__all__ = ["PIECE", "adam_step_", "sgd_step_"]

PIECE = 1 << 20  # elements per piece: 4 MiB a FP32 temporary


def adam_step_(
    grads,
    masters,
    exp_avgs,
    exp_avg_sqs,
    steps,
    lows,
    corrections,
    scales,
    inv_scale,
    found_inf,
    options,
):
    """kernels.adam_step_ over compact masters (`corrections`, masters None) and/or encoded
    moments (`scales`: the two moments' block scales for 8-bit codes; bf16 moments need none)."""
    torch._foreach_add_(steps, 1)
    step = torch._fused_adamw_ if options["decoupled"] else torch._fused_adam_
    m_scales, v_scales = scales if scales is not None else (None, None)
    for i, grad in enumerate(grads):
        for piece in _pieces(grad):
            master = _Master(masters, lows, corrections, i, piece)
            m = _Moment(exp_avgs[i], None if m_scales is None else m_scales[i], True, piece)
            v = _Moment(exp_avg_sqs[i], None if v_scales is None else v_scales[i], False, piece)
            v.step = steps[i]  # its codes are rounded stochastically (_codecs.dither)
            step(
                [master.fp32],
                [_unscaled(grad, piece, inv_scale)],
                [m.fp32],
                [v.fp32],
                [],
                [steps[i]],
                lr=options["lr"],
                beta1=options["beta1"],
                beta2=options["beta2"],
                weight_decay=options["weight_decay"],
                eps=options["eps"],
                amsgrad=False,
                maximize=False,
                found_inf=found_inf,
            )
            master.write_back(found_inf)
            m.write_back(found_inf)
            v.write_back(found_inf)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


def sgd_step_(grads, masters, buffers, lows, corrections, scales, inv_scale, found_inf, options):
    """kernels.sgd_step_ over compact masters and/or encoded momentum buffers (`scales` their
    block scales for 8-bit codes); options["first_step"]: the buffers start as the gradients
    (torch's first step)."""
    momentum = options["momentum"] != 0
    for i, grad in enumerate(grads):
        for piece in _pieces(grad):
            master = _Master(masters, lows, corrections, i, piece)
            buffer = None
            if momentum:
                buffer = _Moment(buffers[i], None if scales is None else scales[i], True, piece)
            torch._fused_sgd_(
                [master.fp32],
                [_unscaled(grad, piece, inv_scale)],
                [] if buffer is None else [buffer.fp32],
                weight_decay=options["weight_decay"],
                momentum=options["momentum"],
                lr=options["lr"],
                dampening=options["dampening"],
                nesterov=options["nesterov"],
                maximize=False,
                is_first_step=bool(options.get("first_step", False)),
                found_inf=found_inf,
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
    compact master."""

    def __init__(self, masters, lows, corrections, index, piece):
        self.low = None if lows is None else lows[index]
        self.correction = None if corrections is None else corrections[index]
        self.piece = piece
        if self.correction is None:
            master = masters[index]
            self.fp32 = _flat(master)[piece]
            self.master = master
        else:
            self.fp32 = _codecs.compact_decode(
                _flat(self.low)[piece], self.correction.view(-1)[piece]
            )

    def write_back(self, found_inf):
        """The stepped values into the master's forms (the old ones where `found_inf` is set)."""
        if self.correction is None:
            if not self.master.is_contiguous():
                _write(self.master, self.piece, self.fp32)  # unchanged by a skipped step
            if self.low is not None:
                _write(self.low, self.piece, self.fp32.to(self.low.dtype), found_inf)
            return
        low, correction = _codecs.compact_encode(self.fp32)
        _write(self.low, self.piece, low, found_inf)
        _write(self.correction, self.piece, correction, found_inf)


class _Moment:
    """A piece of one moment as FP32: a view of an FP32 moment, a bf16 moment upcast, or 8-bit
    codes and their block scales decoded (`signed`: softsign codes, else square-root codes)."""

    def __init__(self, held, scales, signed, piece):
        self.held, self.scales, self.signed, self.piece = held, scales, signed, piece
        self.step = None
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
                values = _codecs.bf16_stochastic(self.fp32, self.step, piece.start)
            _write(held, piece, values, found_inf)
            return
        if self.signed:
            codes, scales = _codecs.signed_encode(self.fp32)
        else:
            codes, scales = _codecs.unsigned_encode(self.fp32, self.step, piece.start)
        old_codes, old_scales = held.view(-1)[piece], self.scales[self.blocks]
        if found_inf is not None:  # a skipped step keeps the codes it had (no sync: a select)
            skipped = found_inf != 0
            codes = torch.where(skipped, old_codes, codes)
            scales = torch.where(skipped, old_scales, scales)
        old_codes.copy_(codes)
        old_scales.copy_(scales)
