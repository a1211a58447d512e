"""The kernel functions as CuPy RawKernels (multi_tensor.cu) on torch's CUDA memory.

Tensors are passed as raw data pointers in a by-value Meta struct: no CuPy arrays, no DLPack, no
copies. Every launch goes to torch's current stream; nothing here synchronises with the host.
Tensors a kernel cannot take (non-contiguous, float64, ...) are handed to the torch backend.
"""

import operator

import torch

from . import _cupy_device as cuda
from . import _layout, _torch_backend
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
_TYPE_NAMES = cuda.TYPE_NAMES
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
    is built for: cuda.STEP_TYPES), and the rows left to the torch backend: those, and the empty
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
        built = (grad_type, low_type or torch.float32) in cuda.STEP_TYPES
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


def adam_step_(grads, masters, exp_avgs, exp_avg_sqs, steps, lows, inv_scale, found_inf, options):
    split = _copy_split(lows)
    if split is not None:
        for indices, picked in split:
            rows = [_pick(row, indices) for row in (grads, masters, exp_avgs, exp_avg_sqs, steps)]
            if indices:
                adam_step_(*rows, picked, inv_scale, found_inf, options)
        return
    groups, rest = _step_groups(grads, lows, masters, exp_avgs, exp_avg_sqs, steps)
    index = masters[0].device.index
    device = cuda.gpu(index)
    arguments = (
        0 if inv_scale is None else inv_scale.data_ptr(),
        0 if found_inf is None else found_inf.data_ptr(),
        float(options["lr"]),
        float(options["beta1"]),
        float(options["beta2"]),
        float(options["eps"]),
        float(options["weight_decay"]),
        int(options["decoupled"]),
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
    if rest:
        _torch_backend.adam_step_(
            *[_pick(row, rest) for row in (grads, masters, exp_avgs, exp_avg_sqs, steps)],
            None if lows is None else _pick(lows, rest),
            inv_scale,
            found_inf,
            options,
        )


def sgd_step_(grads, masters, buffers, lows, inv_scale, found_inf, options):
    split = _copy_split(lows)
    if split is not None:
        for indices, picked in split:
            picked_buffers = _pick(buffers, indices) if options["momentum"] != 0 else buffers
            if indices:
                sgd_step_(
                    _pick(grads, indices),
                    _pick(masters, indices),
                    picked_buffers,
                    picked,
                    inv_scale,
                    found_inf,
                    options,
                )
        return
    momentum_lists = [buffers] if options["momentum"] != 0 else []
    groups, rest = _step_groups(grads, lows, masters, *momentum_lists)
    index = masters[0].device.index
    device = cuda.gpu(index)
    momentum = float(options["momentum"])
    arguments = (
        0 if inv_scale is None else inv_scale.data_ptr(),
        0 if found_inf is None else found_inf.data_ptr(),
        float(options["lr"]),
        momentum,
        float(options["dampening"]),
        float(options["weight_decay"]),
        int(options["nesterov"]),
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
    if rest:
        _torch_backend.sgd_step_(
            _pick(grads, rest),
            _pick(masters, rest),
            _pick(buffers, rest) if momentum != 0 else buffers,
            None if lows is None else _pick(lows, rest),
            inv_scale,
            found_inf,
            options,
        )


# -- the fused steps over compact state -------------------------------------------------------------
# One kernel launch per (gradient type, master, moments) of the rows (amp_compact_adam and
# amp_compact_count_steps, amp_compact_sgd); rows of other types or layouts, and empty ones, go
# to the torch backend.

_BLOCK = 32  # elements per scale of an 8-bit moment (_codecs.BLOCK): a warp of the kernels
_LOWS = (torch.float16, torch.bfloat16)


def _ready(tensor, dtype, numel):
    return tensor.dtype is dtype and tensor.is_contiguous() and tensor.numel() == numel


def _master_kind(i, grad_type, numel, masters, lows, corrections):
    """COMPACT, or the dtype of the copy of an FP32 master (float32: none), or None where no
    kernel takes row i's master."""
    correction = None if corrections is None else corrections[i]
    low = None if lows is None else lows[i]
    if correction is not None:
        if low is not None and _ready(low, torch.bfloat16, numel):
            return cuda.COMPACT if _ready(correction, torch.int8, numel) else None
        return None
    master = None if masters is None else masters[i]
    if master is None or not _ready(master, torch.float32, numel):
        return None
    if low is None:  # the kernels check the copy's pointer: any type with a kernel will do
        return grad_type if grad_type in _LOWS else torch.float32
    return low.dtype if low.dtype in _LOWS and _ready(low, low.dtype, numel) else None


def _moment_kind(i, numel, moments):
    """The kernels' moment type (MOMENT_NAMES) of row i's moments, [(list, its scales or None,
    signed)], as the torch backend reads them: FP32 as held, bf16 without scales, int8 (signed)
    or uint8 codes with scales; None where they are something else or of different kinds."""
    kinds = set()
    for values, scales, signed in moments:
        held = values[i]
        if not (held.is_contiguous() and held.numel() == numel):
            return None
        scale = None if scales is None or held.dtype is torch.float32 else scales[i]
        if scale is None:
            kinds.add(held.dtype if held.dtype in (torch.float32, torch.bfloat16) else None)
        elif held.dtype is (torch.int8 if signed else torch.uint8) and _ready(
            scale, torch.float32, -(-numel // _BLOCK)
        ):
            kinds.add(torch.int8)
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def _compact_groups(grads, masters, lows, corrections, moments):
    """{(gradient dtype, master kind, moment type): indices} of the rows a compact kernel takes,
    and the rows left to the torch backend (those, and the empty ones, whose steps torch counts)."""
    groups, rest = {}, []
    for i, grad in enumerate(grads):
        numel = grad.numel()
        key = None
        if numel and grad.dtype in _TYPE_NAMES and grad.is_contiguous():
            master = _master_kind(i, grad.dtype, numel, masters, lows, corrections)
            moment = _moment_kind(i, numel, moments) if moments else torch.float32
            if (grad.dtype, master) in cuda.COMPACT_MASTERS and moment is not None:
                key = (grad.dtype, master, moment)
        if key is None:
            rest.append(i)
        else:
            groups.setdefault(key, []).append(i)
    return groups, rest


def _pointers(values, indices):
    return [0 if values is None or values[i] is None else values[i].data_ptr() for i in indices]


def _master_pointers(master, masters, lows, corrections, indices):
    """Lists 1 and 2 of a compact launch: the bf16 weights and corrections of compact masters,
    or the FP32 masters and their copies (0: none)."""
    if master == cuda.COMPACT:
        return [_pointers(lows, indices), _pointers(corrections, indices)]
    return [_pointers(masters, indices), _pointers(lows, indices)]


def _list_ends(master, masters, lows, indices):
    """A launch plan's key part, as _ends: the first and last tensors of list 1, and the count."""
    first_list = lows if master == cuda.COMPACT else masters
    return id(first_list[indices[0]]), id(first_list[indices[-1]]), len(indices)


def _picked(values, indices):
    return None if values is None else [values[i] for i in indices]


def compact_adam_step_(
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
    m_scales, v_scales = scales if scales is not None else (None, None)
    groups, rest = _compact_groups(
        grads,
        masters,
        lows,
        corrections,
        [(exp_avgs, m_scales, True), (exp_avg_sqs, v_scales, False)],
    )
    if groups:
        index = grads[0].device.index
        device = cuda.gpu(index)
        found = 0 if found_inf is None else found_inf.data_ptr()
        arguments = (
            0 if inv_scale is None else inv_scale.data_ptr(),
            found,
            float(options["lr"]),
            float(options["beta1"]),
            float(options["beta2"]),
            float(options["eps"]),
            float(options["weight_decay"]),
            int(options["decoupled"]),
        )
    for (grad_type, master, moment), indices in groups.items():
        coded = moment is torch.int8
        pointers = [
            _pointers(grads, indices),
            *_master_pointers(master, masters, lows, corrections, indices),
            _pointers(exp_avgs, indices),
            _pointers(exp_avg_sqs, indices),
            _pointers(m_scales if coded else None, indices),
            _pointers(v_scales if coded else None, indices),
            _pointers(steps, indices),
        ]
        key = (
            "compact_adam",
            grad_type,
            master,
            moment,
            *_list_ends(master, masters, lows, indices),
        )
        launches = cuda.planned(key, device, pointers, [grads[i].numel() for i in indices])
        cuda.run(
            cuda.compact_kernel("amp_compact_adam", grad_type, master, moment),
            launches,
            arguments,
            index,
        )
        cuda.run("amp_compact_count_steps", launches, (found,), index, chunked=False)
    if rest:
        _torch_backend.compact_adam_step_(
            *[_picked(row, rest) for row in (grads, masters, exp_avgs, exp_avg_sqs, steps, lows)],
            _picked(corrections, rest),
            None if scales is None else (_picked(m_scales, rest), _picked(v_scales, rest)),
            inv_scale,
            found_inf,
            options,
        )


def compact_sgd_step_(
    grads, masters, buffers, lows, corrections, scales, inv_scale, found_inf, options
):
    momentum = options["momentum"] != 0
    moments = [(buffers, scales, True)] if momentum else []
    groups, rest = _compact_groups(grads, masters, lows, corrections, moments)
    if groups:
        index = grads[0].device.index
        device = cuda.gpu(index)
        arguments = (
            0 if inv_scale is None else inv_scale.data_ptr(),
            0 if found_inf is None else found_inf.data_ptr(),
            float(options["lr"]),
            float(options["momentum"]),
            float(options["dampening"]),
            float(options["weight_decay"]),
            int(options["nesterov"]),
            int(bool(options.get("first_step", False))),
        )
    for (grad_type, master, moment), indices in groups.items():
        coded = moment is torch.int8
        pointers = [
            _pointers(grads, indices),
            *_master_pointers(master, masters, lows, corrections, indices),
            _pointers(buffers if momentum else None, indices),
            _pointers(scales if coded else None, indices),
            [0] * len(indices),
        ]
        key = (
            "compact_sgd",
            grad_type,
            master,
            moment,
            *_list_ends(master, masters, lows, indices),
        )
        launches = cuda.planned(key, device, pointers, [grads[i].numel() for i in indices])
        cuda.run(
            cuda.compact_kernel("amp_compact_sgd", grad_type, master, moment),
            launches,
            arguments,
            index,
        )
    if rest:
        _torch_backend.compact_sgd_step_(
            _picked(grads, rest),
            _picked(masters, rest),
            _picked(buffers, rest) if momentum else buffers,
            _picked(lows, rest),
            _picked(corrections, rest),
            _picked(scales, rest),
            inv_scale,
            found_inf,
            options,
        )
