"""Multi-tensor kernels for loss scaling and master weights.

`unscale_`, `unscale_to_`, `unscale_add_`, `copy_`, `l2_norm` and `check_` run as CuPy RawKernels
on CUDA tensors when CuPy can be used, and on torch operations otherwise (CPU, no CuPy, or
`AMP_DISABLE_KERNELS=1`), with the same results. So do the fused master steps `adam_step_` and
`sgd_step_` (their hyperparameters one `AdamOptions` / `SGDOptions`), within the bounds their
docstrings state, over every form of the state: FP32 masters, exact ones as bf16 weights with
int16 remainders (`remainder_encode`), compact ones with int8 corrections (`compact_encode`),
FP32, bf16 or 8-bit moments (`moment_encode`). Overflow flags stay on the
device: nothing here waits for the GPU. Importing this package imports neither CuPy nor touches
CUDA; the CuPy backend is probed on the first call with CUDA tensors.
"""

import os

import torch

from .._state import amp_state
from . import _codecs, _torch_backend
from ._options import AdamOptions, SGDOptions

DISABLE_ENV = "AMP_DISABLE_KERNELS"

__all__ = [
    "unscale_",
    "unscale_to_",
    "unscale_add_",
    "copy_",
    "l2_norm",
    "check_",
    "AdamOptions",
    "SGDOptions",
    "adam_step_",
    "sgd_step_",
    "remainder_encode",
    "remainder_decode",
    "compact_encode",
    "compact_decode",
    "moment_encode",
    "moment_decode",
    "moment_scales",
    "MOMENT_BLOCK",
    "fuses",
    "cuda_backend",
    "BackendChoice",
]


class BackendChoice:
    """Which implementation runs on CUDA tensors, and why."""

    def __init__(self, name, module, reason):
        self.name = name  # "cupy" or "torch"
        self.module = module
        self.reason = reason

    def __repr__(self):
        return f"BackendChoice({self.name!r}, reason={self.reason!r})"


def _probe_cuda_backend():
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return BackendChoice("torch", _torch_backend, f"{DISABLE_ENV} is set")
    if not torch.cuda.is_available():
        return BackendChoice("torch", _torch_backend, "CUDA is not available")
    try:
        from . import _cupy_backend

        reason = _cupy_backend.check()
    except Exception as error:  # ImportError, CUDA/NVRTC errors: all mean "use torch"
        return BackendChoice(
            "torch",
            _torch_backend,
            f"CuPy cannot be used ({type(error).__name__}: {error}); "
            "install the extra with `pip install amp[cuda]` for the fused kernels",
        )
    return BackendChoice("cupy", _cupy_backend, reason)


def cuda_backend():
    """The BackendChoice for CUDA tensors (probed once per process)."""
    choice = amp_state.cuda_kernels
    if choice is None:
        choice = amp_state.cuda_kernels = _probe_cuda_backend()
    return choice


def _backend(device):
    return cuda_backend().module if device.type == "cuda" else _torch_backend


_get_device = torch.Tensor.get_device  # an int per tensor: cheaper than building .device
_size = torch.Tensor.size


def _by_device(*lists):
    """Group parallel lists of tensors by the device of the first list's tensors."""
    first = lists[0]
    indices = list(map(_get_device, first))
    if indices.count(indices[0]) == len(indices):
        return [(first[0].device, lists)]
    groups = {}
    for position, index in enumerate(indices):
        groups.setdefault(index, []).append(position)
    return [
        (first[members[0]].device, tuple([values[i] for i in members] for values in lists))
        for members in groups.values()
    ]


def _flagged(name, lists, inv_scale, found_inf, also=()):
    """Run backend function `name`(*lists, inv_scale, flag[, also]) per device, collecting every
    flag in found_inf; `also` (unscale_to_'s) are unscaled in place in the same call where all
    are on the flag's device, else apart."""
    first = lists[0]
    # All on the flag's device (the common case): no Python call but the set's `len`.
    if (
        len({*map(_get_device, first), *map(_get_device, also)}) == 1
        and first[0].device == found_inf.device
    ):
        device = found_inf.device
        module = cuda_backend().module if device.type == "cuda" else _torch_backend
        if inv_scale.device != device:
            inv_scale = inv_scale.to(device, non_blocking=True)
        getattr(module, name)(*lists, inv_scale, found_inf, *((also,) if also else ()))
        return
    if also:
        unscale_(also, inv_scale, found_inf)
    for device, group in _by_device(*lists):
        function = getattr(_backend(device), name)
        if device == found_inf.device:
            function(*group, inv_scale.to(device, non_blocking=True), found_inf)
        else:
            local = torch.zeros((), dtype=torch.float32, device=device)
            function(*group, inv_scale.to(device, non_blocking=True), local)
            found_inf.copy_(torch.maximum(found_inf, local.to(found_inf.device)))


def unscale_(tensors, inv_scale, found_inf):
    """Multiply `tensors` in place by `inv_scale` and set `found_inf` to 1 if any holds inf/NaN.

    The semantics of `torch._amp_foreach_non_finite_check_and_unscale_`: float32, float16 and
    bfloat16 tensors (mixed is fine), arithmetic in float32, every element written even when a
    non-finite value is found, `found_inf` (a float32 1-element tensor) only ever set, never
    cleared. `inv_scale` is a float32 1-element tensor.
    """
    if tensors:
        _flagged("unscale_", (tensors,), inv_scale, found_inf)


def unscale_to_(sources, destinations, inv_scale, found_inf, *, check=True, also=()):
    """destinations = sources * inv_scale: model gradients into FP32 master gradients.

    The multiply is done in float32 and rounded once into the destinations' dtype (a float32
    source beyond float16's range can land inside it). `sources` are checked for inf/NaN. Lists
    are parallel; shapes must match. check=False skips verifying that, for callers that built the
    lists in parallel (amp, every step). `also`: tensors unscaled in place and checked as
    unscale_ does, in the same launch where the backend can (the optimizer's plain gradients).
    """
    if not sources:
        unscale_(also, inv_scale, found_inf)
        return
    if check:
        _check_parallel(sources, destinations)
    _flagged("unscale_to_", (sources, destinations), inv_scale, found_inf, also)


def unscale_add_(sources, destinations, inv_scale, found_inf, *, check=True):
    """destinations += sources * inv_scale: multiply and add in float32, each rounded there, then
    one rounding into the destinations' dtype.

    Accumulates a new (scaled) gradient into gradients kept from earlier backward passes; only
    `sources` are checked for inf/NaN. `check` as for unscale_to_.
    """
    if sources:
        if check:
            _check_parallel(sources, destinations)
        _flagged("unscale_add_", (sources, destinations), inv_scale, found_inf)


def copy_(sources, destinations, *, check=True):
    """destinations = sources, rounded to nearest even: FP32 masters into FP16/BF16 model params.

    `check` as for unscale_to_.
    """
    if sources:
        if check:
            _check_parallel(sources, destinations)
        if len({*map(_get_device, sources)}) == 1:  # one device, as in _flagged
            device = sources[0].device
            (cuda_backend().module if device.type == "cuda" else _torch_backend).copy_(
                sources, destinations
            )
            return
        for device, (src, dst) in _by_device(sources, destinations):
            _backend(device).copy_(src, dst)


def l2_norm(tensors):
    """The L2 norm of all elements of `tensors`, as a float32 0-dim tensor on their device.

    Squares are summed in float64 whatever the tensors' dtype, so gradients whose squares are
    below float32's normal range (1e-19 and smaller) or above its largest (3e19 and larger) still
    give their norm. For gradient clipping:
    `amp.kernels.l2_norm([p.grad for p in amp.master_params(optimizer) if p.grad is not None])`.
    """
    if not tensors:
        raise ValueError("l2_norm needs at least one tensor")
    groups = _by_device(tensors)
    if len(groups) > 1:
        raise ValueError(
            "l2_norm takes tensors on one device; got tensors on "
            f"{sorted(str(device) for device, _ in groups)}"
        )
    device, (group,) = groups[0]
    return _backend(device).l2_norm(group)


def check_(tensors, found_inf):
    """Set `found_inf` to 1 if any element of `tensors` (one device) is inf/NaN, as unscale_
    does, writing nothing else.

    Returns an object whose `tensors()` lists the indices of the tensors that held inf/NaN, read
    from the device when called (a sync on CUDA; amp asks only after a skipped step).
    """
    return _backend(tensors[0].device).check_(tensors, found_inf)


def adam_step_(
    grads,
    lows,
    masters,
    exp_avgs,
    exp_avg_sqs,
    steps,
    options,
    *,
    scales=None,
    inv_scale=None,
    found_inf=None,
    starts=None,
):
    """One step of torch.optim.AdamW (`options.decoupled`) or Adam, fused, on parallel lists of
    one device: the gradients (any float dtype) times `inv_scale` (if given) step each row's
    master, its moments and its step count (float32 0-dim, torch's `state["step"]`) in place.
    Nothing changes where `found_inf` (a float32 flag) is set: the step is skipped on the device,
    and no bit changes.

    A row's master is `masters[i]` in one of three forms: a floating tensor (FP32: the master
    itself, `lows[i]` its low-precision copy, set to its rounding, or None; a plain parameter's
    own tensor in its own dtype), an int16 remainder (exact: `lows[i]` the bf16 weight, the pair
    remainder_encode's) or an int8 correction (compact: compact_encode's). The moments are in the
    master's dtype or FP32, bf16, or 8-bit codes (int8 first, uint8 second) with `scales` the two
    lists of their block scales (moment_encode's). `lows` may be None: no copies.

    Numerics: each element follows torch's formula operation by operation in float32, with the
    fused multiply-adds of torch's CPU kernel's vector body, so the torch backend (that kernel)
    and the CUDA source agree bit for bit where torch's vectors cover the tensor. torch's CPU
    kernel rounds the elements of its scalar tail (past the last full vector of a thread's range)
    without fused multiply-adds: there the CUDA source, which follows the body, can land an ulp
    away (exp_avg_sq up to 3 ulps after 3 steps with FP32 gradients). An exact master with FP32
    moments is stepped by that op on its decoded FP32 value whole, so it is torch's fused step's
    number bit for bit. torch's for-loop and foreach implementations round their last update
    differently and differ from it by a few ulps of the update. The bias corrections are
    computed in double per tensor, as torch does. The 8-bit and bf16 encodings are
    `moment_encode`'s and stochastic rounding's (_codecs.py), the same on both backends.

    A row may be a shard of a tensor (FSDP2's): `starts[i]` is its first element in the
    flattened whole (None: every row a whole tensor), so that the second moment's stochastic
    rounding, drawn by the element's index, is the whole tensor's; a row of 8-bit codes starts at
    a block (a multiple of 32), where its blocks are the whole tensor's.
    """
    if grads:
        if lows is None:
            lows = [None] * len(grads)
        if starts is not None:
            _check_starts(starts, exp_avg_sqs)
            if not any(starts):
                starts = None
        _backend(grads[0].device).adam_step_(
            grads, lows, masters, exp_avgs, exp_avg_sqs, steps, scales, inv_scale, found_inf,
            options, starts,
        )


def _check_starts(starts, exp_avg_sqs):
    for index, (start, moment) in enumerate(zip(starts, exp_avg_sqs)):
        if start % _codecs.BLOCK and moment.dtype is torch.uint8:
            raise ValueError(
                f"row {index} starts at element {start} of its tensor, inside a block of "
                f"{_codecs.BLOCK}: its 8-bit codes' blocks would not be the whole tensor's"
            )


def sgd_step_(
    grads,
    lows,
    masters,
    buffers,
    options,
    *,
    scales=None,
    first_step=False,
    inv_scale=None,
    found_inf=None,
):
    """One step of torch.optim.SGD, fused, as adam_step_: `buffers` the momentum buffers (FP32,
    bf16, or int8 codes with `scales` their block scales; unused without momentum);
    `first_step`: they start as the gradients, as torch's first step makes them (their values
    are not read). Numerics: torch's for-loop and foreach formula, bit for bit; torch's fused SGD
    on the CPU (the torch backend) rounds the elements of its scalar loop (the last few of each
    thread's range) differently, by at most an ulp."""
    if grads:
        if lows is None:
            lows = [None] * len(grads)
        _backend(grads[0].device).sgd_step_(
            grads, lows, masters, buffers, scales, inv_scale, found_inf, options, first_step
        )


def remainder_encode(fp32):
    """(bf16 weights, int16 remainders) of FP32 values: the weight their rounding to nearest (exact
    ties away from zero), the pair the FP32 bits exactly; remainder_decode gives them back."""
    return _codecs.remainder_encode(fp32)


def remainder_decode(bf16, remainders):
    """The FP32 values that remainder_encode's bf16 weights and int16 remainders hold."""
    return _codecs.remainder_decode(bf16, remainders)


def compact_encode(fp32):
    """(bf16 weights, int8 corrections) of FP32 values: their 24-bit rounding, split (within
    1/512 of the bf16 weight's ulp, 1/256 next to half a ulp); compact_decode gives it back
    exactly."""
    return _codecs.compact_encode(fp32)


def compact_decode(bf16, corrections):
    """The FP32 values that compact_encode's bf16 weights and int8 corrections hold."""
    return _codecs.compact_decode(bf16, corrections)


def moment_encode(values, signed):
    """An optimizer moment in 8 bits: (codes in its shape, fp32 scales per block of
    _codecs.BLOCK elements). `signed`: int8 softsign codes (Adam's first moment, SGD's momentum);
    else uint8 codes of the square roots of non-negative values (Adam's second moment)."""
    return (_codecs.signed_encode if signed else _codecs.unsigned_encode)(values)


MOMENT_BLOCK = _codecs.BLOCK  # the elements of an 8-bit moment's block (one scale each)


def moment_scales(numel):
    """How many block scales moment_encode makes for a moment of `numel` elements."""
    return -(-numel // _codecs.BLOCK)


def moment_decode(codes, scales):
    """The FP32 values of moment_encode's codes (their dtype says which encoding) and scales."""
    signed = codes.dtype is torch.int8
    return (_codecs.signed_decode if signed else _codecs.unsigned_decode)(codes, scales)


def fuses(device):
    """Whether the fused kernels run for tensors on `device` (the CuPy backend): a check at
    scale_loss's exit and one pass at the step then cost less than converting gradients."""
    return device.type == "cuda" and cuda_backend().name == "cupy"


def _check_parallel(sources, destinations):
    if len(sources) != len(destinations):
        raise ValueError(
            f"expected as many destinations as sources, got {len(sources)} sources and "
            f"{len(destinations)} destinations"
        )
    if list(map(_size, sources)) == list(map(_size, destinations)) and list(
        map(_get_device, sources)
    ) == list(map(_get_device, destinations)):
        return
    for index, (source, destination) in enumerate(zip(sources, destinations)):
        if source.shape != destination.shape or source.device != destination.device:
            raise ValueError(
                f"source {index} ({tuple(source.shape)} on {source.device}) and destination "
                f"{index} ({tuple(destination.shape)} on {destination.device}) must have the "
                "same shape and device"
            )
