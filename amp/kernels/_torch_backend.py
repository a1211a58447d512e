"""The kernel functions on torch operations: the CPU path, and the CUDA path without CuPy.

Each function takes tensors of one device. Unscaling goes through
`torch._amp_foreach_non_finite_check_and_unscale_`, so this backend is torch's own arithmetic,
and results are bit for bit the kernels': values are read as float32, multiplied and added in
float32, and rounded once into the destination's dtype.
"""

import itertools
import math
import operator

import torch

from ._torch_compact import adam_step_ as compact_adam_step_
from ._torch_compact import sgd_step_ as compact_sgd_step_

__all__ = [
    "unscale_",
    "unscale_to_",
    "unscale_add_",
    "copy_",
    "l2_norm",
    "TensorFlags",
    "check_",
    "adam_step_",
    "sgd_step_",
    "compact_adam_step_",
    "compact_sgd_step_",
]

_unscale_op = torch._amp_foreach_non_finite_check_and_unscale_
_dtype = operator.attrgetter("dtype")  # read at C level: the step's path stays O(1) Python calls
_FLOATING = operator.attrgetter("is_floating_point")
_PIECE = 1 << 20  # elements: a float64 copy of a piece is 8 MiB
# A float32 sum of squares of at least 2**-100 has lost at most n * 2**-150 to subnormal squares.
_SMALL_NORM = 2.0**-50


def _by_dtype(tensors):
    groups = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups.values()


def _unscale_one_by_one(tensors, inv_scale, found_inf):
    # For dtypes a torch build's CUDA kernel does not dispatch (bf16 in some releases): the same
    # arithmetic, fp32 multiply and round to the tensor's dtype, one tensor at a time.
    for tensor in tensors:
        found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(tensor)).any().float()))
        tensor.copy_(tensor.float() * inv_scale)


def unscale_(tensors, inv_scale, found_inf):
    """tensors *= inv_scale in place; found_inf = 1 if any element is inf or NaN."""
    if not tensors:
        return
    if tensors[0].device.type == "cpu":
        # The CPU kernel accepts a list of mixed dtypes.
        _unscale_op(tensors, found_inf, inv_scale)
        return
    for group in _by_dtype(tensors):
        try:
            _unscale_op(group, found_inf, inv_scale)
        except (RuntimeError, NotImplementedError):
            if group[0].dtype is not torch.bfloat16:
                raise
            _unscale_one_by_one(group, inv_scale, found_inf)


# (source dtype, destination dtype) pairs whose copy is exact: into float32, or the same dtype.
_DTYPES = [value for value in vars(torch).values() if isinstance(value, torch.dtype)]
_EXACT_COPIES = frozenset(
    [(dtype, torch.float32) for dtype in _DTYPES] + [(dtype, dtype) for dtype in _DTYPES]
)


def _unscaled_float32(sources, inv_scale, found_inf):
    """float32 copies of `sources` times inv_scale, flagging inf/NaN in found_inf."""
    scaled = [source.to(torch.float32, copy=True) for source in sources]
    unscale_(scaled, inv_scale, found_inf)
    return scaled


def unscale_to_(sources, destinations, inv_scale, found_inf, also=()):
    """destinations = sources * inv_scale: the multiply in float32, then one rounding into the
    destinations' dtype, as the kernel does (70000 * 2**-10 into float16 is 68.375, no overflow).
    `also` are unscaled in place with the destinations (one launch per dtype)."""
    if not sources:
        unscale_(also, inv_scale, found_inf)
        return
    if set(zip(map(_dtype, sources), map(_dtype, destinations))) <= _EXACT_COPIES:
        # The copy is exact, so unscaling the destinations in place rounds once, with no copy.
        torch._foreach_copy_(destinations, sources)
        tensors = [*also, *destinations] if also else destinations
        if destinations[0].is_cpu:  # unscale_'s CPU case, inlined: O2 runs it every step
            _unscale_op(tensors, found_inf, inv_scale)
        else:
            unscale_(tensors, inv_scale, found_inf)
        return
    unscale_(also, inv_scale, found_inf)
    torch._foreach_copy_(destinations, _unscaled_float32(sources, inv_scale, found_inf))


def unscale_add_(sources, destinations, inv_scale, found_inf):
    """destinations += sources * inv_scale: multiply and add in float32 (each rounded there), then
    one rounding into the destinations' dtype, as the kernel does. Only `sources` are checked."""
    if not sources:
        return
    scaled = _unscaled_float32(sources, inv_scale, found_inf)
    if set(map(_dtype, destinations)) == {torch.float32}:
        torch._foreach_add_(destinations, scaled)
        return
    torch._foreach_add_(scaled, destinations)  # float32 += destination, exactly converted
    torch._foreach_copy_(destinations, scaled)


def copy_(sources, destinations):
    """destinations = sources, converted (round to nearest even) to the destinations' dtype."""
    if sources:
        torch._foreach_copy_(destinations, sources)


def _norm(tensors, dtype):
    try:
        norms = torch._foreach_norm(tensors, 2.0, dtype=dtype)
    except TypeError:  # torch releases whose _foreach_norm has no dtype argument
        norms = [torch.linalg.vector_norm(tensor, dtype=dtype) for tensor in tensors]
    return torch.linalg.vector_norm(torch.stack(norms))


def _pieces(tensors):
    """The tensors, large contiguous ones split into views of _PIECE elements."""
    pieces = []
    for tensor in tensors:
        if tensor.numel() > _PIECE and tensor.is_contiguous():
            pieces.extend(tensor.view(-1).split(_PIECE))
        else:
            pieces.append(tensor)
    return pieces


def l2_norm(tensors):
    """The L2 norm of all elements of `tensors` together, as a float32 0-dim tensor.

    Squares summed in float64, as the kernel does: in float32, squares below 2**-126 lose their
    digits (or vanish) and squares above 2**128 overflow, so tiny or huge gradients gave a wrong
    norm, 0 or inf. On CUDA, torch's _foreach_norm sums in float64 as it reads. On the CPU it
    first copies each tensor to float64 (about 30 times slower), so there the float32 norm is
    kept where it cannot be affected (finite, at least _SMALL_NORM) and the others are summed
    again in float64, a piece at a time.
    """
    device = tensors[0].device
    if device.type == "cuda":
        return _norm(tensors, torch.float64).float()
    norm = _norm(tensors, torch.float32)
    value = norm.item() if device.type == "cpu" else 1.0  # no float64 on some devices (mps)
    if not (value < _SMALL_NORM or value == math.inf):  # NaN stays NaN
        return norm
    return _norm(_pieces(tensors), torch.float64).float()


# -- the check alone and the fused master steps ---------------------------------------------------


class TensorFlags:
    """Which of the checked tensors held inf/NaN, on the device until asked."""

    def __init__(self, flags):
        self._flags = flags  # bool per tensor

    def tensors(self):
        """Indices of the tensors that held inf/NaN (reads the device)."""
        return [index for index, bad in enumerate(self._flags.tolist()) if bad]


def check_(tensors, found_inf):
    """found_inf = 1 if any element of `tensors` is inf/NaN, nothing else written. Returns their
    TensorFlags."""
    flags = torch.stack([torch.isfinite(t).all().logical_not() for t in tensors])
    found_inf.copy_(torch.maximum(found_inf, flags.any().to(found_inf.dtype)))
    return TensorFlags(flags)


def _unscaled_gradients(grads, inv_scale):
    """The gradients to step with: the (low-precision, deferred) gradients of FP32 masters times
    inv_scale in FP32 (one rounding in float32), or, with no scale, the gradients themselves, in
    their parameters' dtype (a plain float64 or FP16 parameter is stepped in its own dtype)."""
    if inv_scale is None:
        return grads
    copies = [torch.empty_like(grad, dtype=torch.float32) for grad in grads]
    torch._foreach_copy_(copies, grads)  # exact
    torch._foreach_mul_(copies, inv_scale)
    return copies


NONES = itertools.repeat(None)  # with map(operator.is_not, ...): a C-level "is not None" per item


def _one_dtype_each(masters, *rows):
    """[rows] with the masters of one dtype each (torch's fused ops take one), `rows` parallel
    lists (or None); one group, the lists as given, in the usual case."""
    dtypes = list(map(_dtype, masters))
    if dtypes.count(dtypes[0]) == len(dtypes):
        return ((masters, *rows),)
    groups = {}
    for index, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(index)
    return [
        [None if row is None else [row[i] for i in indices] for row in (masters, *rows)]
        for indices in groups.values()
    ]


def _copy_back(lows, masters):
    """lows = masters (rounded to their dtype) where a row has one (None: a plain parameter)."""
    if lows is None:
        return
    if not all(map(operator.is_not, lows, NONES)):
        present = list(map(operator.is_not, lows, NONES))
        lows = list(itertools.compress(lows, present))
        masters = list(itertools.compress(masters, present))
    if lows:
        torch._foreach_copy_(lows, masters)


def _torch_format(masters, moments, scales):
    """Indices of the rows torch's fused op steps as they are (a floating master whose moments
    are of its dtype: torch's format), of the others (compact forms: _torch_compact.py); None for
    both where every row is of the first kind, (None, None) / ([], None) as the lists say."""
    masters_dtypes = list(map(_dtype, masters))
    floating = list(map(_FLOATING, masters_dtypes))
    same = [list(map(operator.is_, map(_dtype, m), masters_dtypes)) for m in moments if m]
    if scales is None and all(floating) and all(map(all, same)):
        return None, None
    if not any(floating):  # every master compact
        return [], list(range(len(masters)))
    plain, other = [], []
    for i, is_floating in enumerate(floating):
        torch_format = scales is None and is_floating and all(s[i] for s in same)
        (plain if torch_format else other).append(i)
    return plain, other


def _pick(values, indices):
    return None if values is None else [values[i] for i in indices]


def adam_step_(grads, lows, masters, exp_avgs, exp_avg_sqs, steps, scales, inv_scale, found_inf,
               options, starts=None):
    """One step of AdamW (options.decoupled) or Adam: torch's fused op on the rows in torch's
    format, once per dtype of the masters; the compact forms' rows by _torch_compact.py."""
    plain, other = _torch_format(masters, (exp_avgs, exp_avg_sqs), scales)
    if plain is None:
        rows = (masters, grads, exp_avgs, exp_avg_sqs, steps, lows)
        for group in _one_dtype_each(*rows):
            _adam_step(*group, inv_scale, found_inf, options)
        return
    rows = (grads, lows, masters, exp_avgs, exp_avg_sqs, steps)
    if not plain:  # every row compact: the lists as they are
        compact_adam_step_(*rows, scales, inv_scale, found_inf, options, starts)
        return
    adam_step_(*[_pick(r, plain) for r in rows], None, inv_scale, found_inf, options)
    if other:
        scale_lists = None if scales is None else tuple(_pick(s, other) for s in scales)
        compact_adam_step_(
            *[_pick(r, other) for r in rows], scale_lists, inv_scale, found_inf, options,
            _pick(starts, other),
        )


def _adam_step(masters, grads, exp_avgs, exp_avg_sqs, steps, lows, inv_scale, found_inf, options):
    grads = _unscaled_gradients(grads, inv_scale)
    torch._foreach_add_(steps, 1)
    step = options.fused_op()
    step(
        masters,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        **options.fused_kwargs(found_inf),
    )
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))
    _copy_back(lows, masters)


def sgd_step_(grads, lows, masters, buffers, scales, inv_scale, found_inf, options, first_step):
    """One step of SGD: torch's fused op on the rows in torch's format, once per dtype of the
    masters (`first_step`: the buffers start as the gradients); the compact forms' rows by
    _torch_compact.py."""
    momentum = options.momentum != 0
    plain, other = _torch_format(
        masters, (buffers if momentum else None,), scales if momentum else None
    )
    if plain is None:
        for group in _one_dtype_each(masters, grads, buffers if momentum else None, lows):
            _sgd_step(*group, inv_scale, found_inf, options, first_step)
        return
    if not plain:  # every row compact: the lists as they are
        compact_sgd_step_(
            grads, lows, masters, buffers, scales, inv_scale, found_inf, options, first_step
        )
        return
    sgd_step_(
        _pick(grads, plain), _pick(lows, plain), _pick(masters, plain),
        _pick(buffers, plain) if momentum else buffers, None, inv_scale, found_inf,
        options, first_step,
    )
    if other:
        compact_sgd_step_(
            _pick(grads, other), _pick(lows, other), _pick(masters, other),
            _pick(buffers, other) if momentum else buffers,
            None if scales is None else _pick(scales, other),
            inv_scale, found_inf, options, first_step,
        )


def _sgd_step(masters, grads, buffers, lows, inv_scale, found_inf, options, first_step):
    grads = _unscaled_gradients(grads, inv_scale)
    torch._fused_sgd_(
        masters,
        grads,
        [] if buffers is None else buffers,
        **options.fused_kwargs(found_inf, first_step),
    )
    _copy_back(lows, masters)
