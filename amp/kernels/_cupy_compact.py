"""The CuPy kernels' fused steps over compact state (`_codecs.py`, compact.cu's
amp_compact_adam, amp_compact_count_steps and amp_compact_sgd): one launch per (gradient type,
master kind, moment type) of the rows, reading and writing the bf16 weight, its remainder or
correction and the moments' codes in one pass, with the torch backend's bits
(`_torch_compact.py`). Rows of other types or layouts, and empty ones, go to the torch backend.
"""

import torch

from . import _codecs, _sources, _torch_backend
from . import _cupy_device as cuda

__all__ = ["adam_step_", "sgd_step_"]

_LOWS = (torch.float16, torch.bfloat16)
_RESTS = {torch.int8: _sources.COMPACT, torch.int16: _sources.REMAINDER}  # a master's rest: its kind
_KINDS = frozenset(_RESTS.values())


def _ready(tensor, dtype, numel):
    return tensor.dtype is dtype and tensor.is_contiguous() and tensor.numel() == numel


def _master_kind(i, grad_type, numel, masters, lows):
    """COMPACT or REMAINDER (a bf16 weight and its int8 correction or int16 remainder), or the
    dtype of the copy of an FP32 master (float32: none), or None where no kernel takes row i's
    master."""
    master = masters[i]
    low = None if lows is None else lows[i]
    kind = _RESTS.get(master.dtype)
    if kind is not None:
        ready = low is not None and _ready(low, torch.bfloat16, numel)
        return kind if ready and _ready(master, master.dtype, numel) else None
    if not _ready(master, torch.float32, numel):
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
            scale, torch.float32, -(-numel // _codecs.BLOCK)
        ):
            kinds.add(torch.int8)
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def _compact_groups(grads, masters, lows, moments):
    """{(gradient dtype, master kind, moment type): indices} of the rows a compact kernel takes,
    and the rows left to the torch backend (those, and the empty ones, whose steps torch counts)."""
    groups, rest = {}, []
    for i, grad in enumerate(grads):
        numel = grad.numel()
        key = None
        if numel and grad.dtype in _sources.TYPE_NAMES and grad.is_contiguous():
            master = _master_kind(i, grad.dtype, numel, masters, lows)
            moment = _moment_kind(i, numel, moments) if moments else torch.float32
            if (grad.dtype, master) in _sources.COMPACT_MASTERS and moment is not None:
                key = (grad.dtype, master, moment)
        if key is None:
            rest.append(i)
        else:
            groups.setdefault(key, []).append(i)
    return groups, rest


def _pointers(values, indices):
    return [0 if values is None or values[i] is None else values[i].data_ptr() for i in indices]


def _master_pointers(master, masters, lows, indices):
    """Lists 1 and 2 of a compact launch: the bf16 weights and their rests (remainders or
    corrections), or the FP32 masters and their copies (0: none)."""
    if master in _KINDS:
        return [_pointers(lows, indices), _pointers(masters, indices)]
    return [_pointers(masters, indices), _pointers(lows, indices)]


def _list_ends(master, masters, lows, indices):
    """A launch plan's key part, as _ends: the first and last tensors of list 1, and the count."""
    first_list = lows if master in _KINDS else masters
    return id(first_list[indices[0]]), id(first_list[indices[-1]]), len(indices)


def _picked(values, indices):
    return None if values is None else [values[i] for i in indices]


def _starts(starts, indices, device):
    """The rows' starts (kernels.adam_step_'s) as an int64 device tensor, kept while they are the
    same (None: all 0)."""
    if starts is None:
        return None
    picked = tuple(starts[i] for i in indices)
    if not any(picked):
        return None
    key = (device, picked)
    if key not in _STARTS:
        if len(_STARTS) >= 16:
            del _STARTS[next(iter(_STARTS))]
        _STARTS[key] = torch.tensor(picked, dtype=torch.int64, device=device)
    return _STARTS[key]


_STARTS = {}  # (device, starts) -> their device tensor: a shard's start stays, step after step


def adam_step_(
    grads, lows, masters, exp_avgs, exp_avg_sqs, steps, scales, inv_scale, found_inf, options,
    starts=None,
):
    m_scales, v_scales = scales if scales is not None else (None, None)
    groups, rest = _compact_groups(
        grads, masters, lows, [(exp_avgs, m_scales, True), (exp_avg_sqs, v_scales, False)]
    )
    if groups:
        index = grads[0].device.index
        device = cuda.gpu(index)
        found = 0 if found_inf is None else found_inf.data_ptr()
        arguments = (
            0 if inv_scale is None else inv_scale.data_ptr(),
            found,
            float(options.lr),
            float(options.beta1),
            float(options.beta2),
            float(options.eps),
            float(options.weight_decay),
            int(options.decoupled),
        )
    for (grad_type, master, moment), indices in groups.items():
        coded = moment is torch.int8
        pointers = [
            _pointers(grads, indices),
            *_master_pointers(master, masters, lows, indices),
            _pointers(exp_avgs, indices),
            _pointers(exp_avg_sqs, indices),
            _pointers(m_scales if coded else None, indices),
            _pointers(v_scales if coded else None, indices),
            _pointers(steps, indices),
        ]
        key = ("compact_adam", grad_type, master, moment, *_list_ends(master, masters, lows, indices))
        launches = cuda.planned(key, device, pointers, [grads[i].numel() for i in indices])
        cuda.run(
            _sources.compact_kernel("amp_compact_adam", grad_type, master, moment),
            launches,
            arguments,
            index,
            rows=_starts(starts, indices, grads[0].device),
        )
        cuda.run("amp_compact_count_steps", launches, (found,), index, chunked=False)
    if rest:
        _torch_backend.compact_adam_step_(
            *[_picked(row, rest) for row in (grads, lows, masters, exp_avgs, exp_avg_sqs, steps)],
            None if scales is None else (_picked(m_scales, rest), _picked(v_scales, rest)),
            inv_scale,
            found_inf,
            options,
            _picked(starts, rest),
        )


def sgd_step_(grads, lows, masters, buffers, scales, inv_scale, found_inf, options, first_step):
    momentum = options.momentum != 0
    moments = [(buffers, scales, True)] if momentum else []
    groups, rest = _compact_groups(grads, masters, lows, moments)
    if groups:
        index = grads[0].device.index
        device = cuda.gpu(index)
        arguments = (
            0 if inv_scale is None else inv_scale.data_ptr(),
            0 if found_inf is None else found_inf.data_ptr(),
            float(options.lr),
            float(options.momentum),
            float(options.dampening),
            float(options.weight_decay),
            int(options.nesterov),
            int(bool(first_step)),
        )
    for (grad_type, master, moment), indices in groups.items():
        coded = moment is torch.int8
        pointers = [
            _pointers(grads, indices),
            *_master_pointers(master, masters, lows, indices),
            _pointers(buffers if momentum else None, indices),
            _pointers(scales if coded else None, indices),
            [0] * len(indices),
        ]
        key = ("compact_sgd", grad_type, master, moment, *_list_ends(master, masters, lows, indices))
        launches = cuda.planned(key, device, pointers, [grads[i].numel() for i in indices])
        cuda.run(
            _sources.compact_kernel("amp_compact_sgd", grad_type, master, moment),
            launches,
            arguments,
            index,
        )
    if rest:
        _torch_backend.compact_sgd_step_(
            _picked(grads, rest),
            _picked(lows, rest),
            _picked(masters, rest),
            _picked(buffers, rest) if momentum else buffers,
            _picked(scales, rest),
            inv_scale,
            found_inf,
            options,
            first_step,
        )
