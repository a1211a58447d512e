"""The kernel functions as CuPy RawKernels (amp/kernels/*.cu, by family) on torch's CUDA memory.

Tensors are passed as raw data pointers in a by-value Meta struct: no CuPy arrays, no DLPack, no
copies. Every launch goes to torch's current stream; nothing here synchronises with the host.
Tensors a kernel cannot take (non-contiguous, float64, ...) are handed to the torch backend.
"""

import operator

import torch

from . import _cupy_device as cuda
from . import _layout, _sources, _torch_backend
from ._cupy_compact import adam_step_ as compact_adam_step_
from ._cupy_compact import sgd_step_ as compact_sgd_step_
from ._torch_backend import NONES

__all__ = [
    "check",
    "unscale_",
    "unscale_to_",
    "unscale_add_",
    "copy_",
    "l2_norm",
    "ChunkFlags",
    "check_",
    "adam_step_",
    "sgd_step_",
    "compact_adam_step_",
    "compact_sgd_step_",
]

check = cuda.check  # compiles for the current GPU (the probe of amp.kernels.cuda_backend)
_TYPE_NAMES = _sources.TYPE_NAMES
_grouped, _pick = cuda.grouped, cuda.pick
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel


def unscale_(tensors, inv_scale, found_inf):
    groups, rest = _grouped(tensors)
    for (dtype,), indices in groups.items():
        cuda.launch(
            f"amp_unscale<{_TYPE_NAMES[dtype]}>",
            [_pick(tensors, indices)],
            (inv_scale.data_ptr(), found_inf.data_ptr()),
        )
    if rest:
        _torch_backend.unscale_(_pick(tensors, rest), inv_scale, found_inf)


def _pairwise(kernel, torch_fallback, sources, destinations, scale, found_inf):
    groups, rest = _grouped(sources, destinations)
    for pair, indices in groups.items():
        if pair not in cuda.SUPPORTED_PAIRS:
            rest.extend(range(len(sources)) if indices is None else indices)
            continue
        cuda.launch(
            f"{kernel}<{_TYPE_NAMES[pair[0]]}, {_TYPE_NAMES[pair[1]]}>",
            [_pick(sources, indices), _pick(destinations, indices)],
            (
                0 if scale is None else scale.data_ptr(),
                0 if found_inf is None else found_inf.data_ptr(),
            ),
        )
    if rest:
        rest.sort()
        torch_fallback(_pick(sources, rest), _pick(destinations, rest))


def unscale_to_(sources, destinations, inv_scale, found_inf, also=()):
    if also:  # another kernel: the copy's kernel reads and writes other tensors
        unscale_(also, inv_scale, found_inf)
    _pairwise(
        "amp_scale_copy",
        lambda src, dst: _torch_backend.unscale_to_(src, dst, inv_scale, found_inf),
        sources,
        destinations,
        inv_scale,
        found_inf,
    )


def unscale_add_(sources, destinations, inv_scale, found_inf):
    _pairwise(
        "amp_scale_add",
        lambda src, dst: _torch_backend.unscale_add_(src, dst, inv_scale, found_inf),
        sources,
        destinations,
        inv_scale,
        found_inf,
    )


def copy_(sources, destinations):
    _pairwise("amp_scale_copy", _torch_backend.copy_, sources, destinations, None, None)


def l2_norm(tensors):
    groups, rest = _grouped(tensors)
    device = tensors[0].device
    out = torch.empty((), dtype=torch.float32, device=device)
    if rest or len(groups) > 1:
        # Mixed dtypes or layouts: the norm group by group, then the norm of those in double.
        parts = [_torch_backend.l2_norm(_pick(tensors, rest))] if rest else []
        parts += [l2_norm(_pick(tensors, indices)) for indices in groups.values()]
        return torch.linalg.vector_norm(torch.stack(parts), dtype=torch.float64).float()
    (((dtype,), indices),) = groups.items()
    chosen = _pick(tensors, indices)
    total = sum((t.numel() + _layout.CHUNK - 1) // _layout.CHUNK for t in chosen)
    if total == 0:
        return out.zero_()
    partial = torch.empty(total, dtype=torch.float64, device=device)  # sums of squares, per chunk
    cuda.launch(
        f"amp_sum_squares<{_TYPE_NAMES[dtype]}>",
        [chosen],
        (partial.data_ptr(),),
        first_chunk_argument=True,
    )
    index = device.index
    with cuda.on_gpu(index):
        cuda.gpu(index).functions["amp_norm_finalize"](
            (1,),
            (_layout.BLOCK,),
            (partial.data_ptr(), total, out.data_ptr()),
            stream=cuda.stream(index),
        )
    return out


# -- the check alone and the fused master steps ---------------------------------------------------


class ChunkFlags:
    """Which of the checked tensors held inf/NaN, as flags per chunk on the device until asked."""

    def __init__(self, flags, chunks, rest):
        self._flags = flags  # uint8 per chunk, in launch order
        self._chunks = chunks  # [(tensor index, its chunk count)] in launch order
        self._rest = rest  # (indices, TensorFlags) of the tensors the torch backend checked

    def tensors(self):
        """Indices of the tensors that held inf/NaN (reads the device)."""
        flags = self._flags.tolist() if self._chunks else []
        found, start = [], 0
        for index, count in self._chunks:
            if any(flags[start : start + count]):
                found.append(index)
            start += count
        if self._rest is not None:
            indices, rest = self._rest
            found += [indices[i] for i in rest.tensors()]
        return sorted(found)


def check_(tensors, found_inf):
    groups, rest = _grouped(tensors)
    index = tensors[0].device.index
    device = cuda.gpu(index)
    chunks = []
    for indices in groups.values():
        for i in range(len(tensors)) if indices is None else indices:
            count = -(-tensors[i].numel() // _layout.CHUNK)
            if count:
                chunks.append((i, count))
    flags = torch.empty(
        sum(count for _, count in chunks), dtype=torch.uint8, device=tensors[0].device
    )
    first = 0
    for (dtype,), indices in groups.items():
        chosen = _pick(tensors, indices)
        numels = list(map(_numel, chosen))
        launches = _layout.plan([list(map(_data_ptr, chosen))], numels, device.capacity[1])
        for packed in launches:
            packed.first_chunk += first
        cuda.run(
            f"amp_check<{_TYPE_NAMES[dtype]}>",
            launches,
            (found_inf.data_ptr(), flags.data_ptr()),
            index,
            first_chunk_argument=True,
        )
        first += sum(packed.chunks for packed in launches)
    checked_rest = None
    if rest:
        chosen = _pick(tensors, rest)
        checked_rest = (rest, _torch_backend.check_(chosen, found_inf))
    return ChunkFlags(flags, chunks, checked_rest)


def _step_groups(grads, lows, *state):
    """{(gradient dtype, low dtype or None): indices} of the rows a fused kernel takes (every
    tensor contiguous, the master and its state float32, the gradient and weight types a kernel
    is built for: _sources.STEP_TYPES), and the rows left to the torch backend: those, and the empty
    ones (launches leave them out, and torch counts their steps too)."""
    groups, rest = _grouped(grads, *state, *([lows] if lows is not None else []))
    numels = list(map(_numel, grads))
    if 0 in numels:
        empty = {i for i, n in enumerate(numels) if n == 0}
        rest = sorted({*rest, *empty})
        all_rows = range(len(grads))
        groups = {
            key: kept
            for key, indices in groups.items()
            if (kept := [i for i in (all_rows if indices is None else indices) if i not in empty])
        }
    taken = {}
    for key, indices in groups.items():
        grad_type, low_type = key[0], key[-1] if lows is not None else None
        state_types = key[1 : len(state) + 1]
        built = (grad_type, low_type or torch.float32) in _sources.STEP_TYPES
        if all(t is torch.float32 for t in state_types) and built:
            taken[(grad_type, low_type)] = indices
        else:
            rest.extend(range(len(grads)) if indices is None else indices)
    return taken, sorted(rest)


def _ends(masters):
    """A launch plan's key part for a list of masters: its first and last tensors, the same from
    step to step whichever list object holds them (planned compares the pointers anyway)."""
    return id(masters[0]), id(masters[-1])


def _copy_split(lows):
    """[(indices, lows)]: the rows with a low-precision copy, and those without (None in `lows`,
    a plain parameter in a group of masters); None if `lows` has no None."""
    if lows is None or all(map(operator.is_not, lows, NONES)):
        return None
    with_copy = [i for i, low in enumerate(lows) if low is not None]
    without = [i for i, low in enumerate(lows) if low is None]
    return [(with_copy, _pick(lows, with_copy)), (without, None)]


def adam_step_(
    grads, lows, masters, exp_avgs, exp_avg_sqs, steps, scales, inv_scale, found_inf, options,
    starts=None,
):
    plain, other = _torch_backend._torch_format(masters, (exp_avgs, exp_avg_sqs), scales)
    if plain is None:
        _fp32_adam(grads, masters, exp_avgs, exp_avg_sqs, steps, lows, inv_scale, found_inf, options)
        return
    if plain:
        _fp32_adam(
            *[_pick(row, plain) for row in (grads, masters, exp_avgs, exp_avg_sqs, steps)],
            None if lows is None else _pick(lows, plain),
            inv_scale,
            found_inf,
            options,
        )
    if other:
        compact_adam_step_(
            *[_pick(row, other) for row in (grads, lows, masters, exp_avgs, exp_avg_sqs, steps)],
            None if scales is None else tuple(_pick(s, other) for s in scales),
            inv_scale,
            found_inf,
            options,
            None if starts is None else _pick(starts, other),
        )


def _fp32_adam(grads, masters, exp_avgs, exp_avg_sqs, steps, lows, inv_scale, found_inf, options):
    """amp_adam over FP32 masters and moments (torch's format); the rows it is not built for to
    the compact kernels."""
    split = _copy_split(lows)
    if split is not None:
        for indices, picked in split:
            rows = [_pick(row, indices) for row in (grads, masters, exp_avgs, exp_avg_sqs, steps)]
            if indices:
                _fp32_adam(*rows, picked, inv_scale, found_inf, options)
        return
    groups, rest = _step_groups(grads, lows, masters, exp_avgs, exp_avg_sqs, steps)
    index = masters[0].device.index
    device = cuda.gpu(index)
    arguments = (
        0 if inv_scale is None else inv_scale.data_ptr(),
        0 if found_inf is None else found_inf.data_ptr(),
        float(options.lr),
        float(options.beta1),
        float(options.beta2),
        float(options.eps),
        float(options.weight_decay),
        int(options.decoupled),
    )
    for (grad_type, low_type), indices in groups.items():
        rows = [grads, masters, exp_avgs, exp_avg_sqs]
        rows = [_pick(row, indices) for row in rows]
        pointers = [list(map(_data_ptr, row)) for row in rows]
        count = len(rows[0])
        pointers.append(list(map(_data_ptr, _pick(lows, indices))) if low_type else [0] * count)
        pointers.append(list(map(_data_ptr, _pick(steps, indices))))
        key = ("adam", grad_type, low_type, *_ends(rows[1]), count)
        launches = cuda.planned(key, device, pointers, list(map(_numel, rows[0])))
        types = f"{_TYPE_NAMES[grad_type]}, {_TYPE_NAMES[low_type or torch.float32]}"
        cuda.run(f"amp_adam<{types}>", launches, arguments, index)
        cuda.run("amp_count_steps", launches, (arguments[1],), index, chunked=False)
    if rest:  # the compact kernels take FP32 masters too (and leave the rest to torch)
        compact_adam_step_(
            _pick(grads, rest),
            [None] * len(rest) if lows is None else _pick(lows, rest),
            *[_pick(row, rest) for row in (masters, exp_avgs, exp_avg_sqs, steps)],
            None,
            inv_scale,
            found_inf,
            options,
        )


def sgd_step_(grads, lows, masters, buffers, scales, inv_scale, found_inf, options, first_step):
    momentum = options.momentum != 0
    plain, other = _torch_backend._torch_format(
        masters, (buffers if momentum else None,), scales if momentum else None
    )
    if first_step:  # amp_sgd does not start buffers; the compact kernel takes FP32 masters too
        compact_sgd_step_(
            grads, lows, masters, buffers, scales, inv_scale, found_inf, options, first_step
        )
        return
    if plain is None:
        _fp32_sgd(grads, masters, buffers, lows, inv_scale, found_inf, options)
        return
    if plain:
        _fp32_sgd(
            _pick(grads, plain),
            _pick(masters, plain),
            _pick(buffers, plain) if momentum else buffers,
            None if lows is None else _pick(lows, plain),
            inv_scale,
            found_inf,
            options,
        )
    if other:
        compact_sgd_step_(
            _pick(grads, other),
            None if lows is None else _pick(lows, other),
            _pick(masters, other),
            _pick(buffers, other) if momentum else buffers,
            None if scales is None else _pick(scales, other),
            inv_scale,
            found_inf,
            options,
            first_step,
        )


def _fp32_sgd(grads, masters, buffers, lows, inv_scale, found_inf, options):
    """amp_sgd over FP32 masters and buffers (torch's format), buffers made already; the rows it
    is not built for to the compact kernels."""
    split = _copy_split(lows)
    momentum = options.momentum
    if split is not None:
        for indices, picked in split:
            picked_buffers = _pick(buffers, indices) if momentum != 0 else buffers
            if indices:
                _fp32_sgd(
                    _pick(grads, indices),
                    _pick(masters, indices),
                    picked_buffers,
                    picked,
                    inv_scale,
                    found_inf,
                    options,
                )
        return
    momentum_lists = [buffers] if momentum != 0 else []
    groups, rest = _step_groups(grads, lows, masters, *momentum_lists)
    index = masters[0].device.index
    device = cuda.gpu(index)
    arguments = (
        0 if inv_scale is None else inv_scale.data_ptr(),
        0 if found_inf is None else found_inf.data_ptr(),
        float(options.lr),
        float(momentum),
        float(options.dampening),
        float(options.weight_decay),
        int(options.nesterov),
    )
    for (grad_type, low_type), indices in groups.items():
        rows = [_pick(grads, indices), _pick(masters, indices)]
        pointers = [list(map(_data_ptr, row)) for row in rows]
        count = len(rows[0])
        pointers.append(
            list(map(_data_ptr, _pick(buffers, indices))) if momentum != 0 else [0] * count
        )
        pointers.append(list(map(_data_ptr, _pick(lows, indices))) if low_type else [0] * count)
        key = ("sgd", grad_type, low_type, *_ends(rows[1]), count)
        launches = cuda.planned(key, device, pointers, list(map(_numel, rows[0])))
        types = f"{_TYPE_NAMES[grad_type]}, {_TYPE_NAMES[low_type or torch.float32]}"
        cuda.run(f"amp_sgd<{types}>", launches, arguments, index)
    if rest:  # the compact kernels take FP32 masters too (and leave the rest to torch)
        compact_sgd_step_(
            _pick(grads, rest),
            [None] * len(rest) if lows is None else _pick(lows, rest),
            _pick(masters, rest),
            _pick(buffers, rest) if momentum != 0 else buffers,
            None,
            inv_scale,
            found_inf,
            options,
            False,
        )
