"""The CuPy side of the kernels: the compiled module per GPU, torch's current stream, and the
launches (one Meta struct by value per launch, amp/kernels/_layout.py), packed anew or kept while
the tensors stay the same.
"""

import itertools
import operator
import os
import pathlib

import cupy
import torch

from . import _layout

__all__ = [
    "PARAM_BYTES_ENV",
    "TYPE_NAMES",
    "STEP_TYPES",
    "COMPACT",
    "REMAINDER",
    "COMPACT_MASTERS",
    "MOMENT_NAMES",
    "compact_kernel",
    "SUPPORTED_PAIRS",
    "nvrtc_version",
    "on_gpu",
    "gpu",
    "stream",
    "check",
    "launch",
    "grouped",
    "pick",
    "planned",
    "run",
]

PARAM_BYTES_ENV = "AMP_KERNEL_PARAM_BYTES"  # force the 4 KB layout on GPUs that allow 32 KB
_SOURCE = pathlib.Path(__file__).with_name("multi_tensor.cu").read_text()
TYPE_NAMES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
# (gradient, weight) types of the fused steps: the weight's type, or an FP32 gradient (made by a
# read of the masters' `.grad` before the step) for any weight; float32 stands for no weight.
STEP_TYPES = frozenset(
    [(t, t) for t in TYPE_NAMES] + [(torch.float32, t) for t in (torch.float16, torch.bfloat16)]
)
COMPACT = "compact"  # the master of a compact step held as a bf16 weight and an int8 correction
REMAINDER = "remainder"  # ... as a bf16 weight and an int16 remainder (an exact master)
_MASTER_NAMES = {COMPACT: "amp::Compact", REMAINDER: "amp::Remainder"}
# (gradient, master) types of the compact steps: a bf16 weight with its correction or remainder and
# any gradient type, or an FP32 master with a copy of the types the fused steps write
# (STEP_TYPES; float32: no copy).
COMPACT_MASTERS = frozenset(
    [(t, kind) for t in TYPE_NAMES for kind in _MASTER_NAMES] + list(STEP_TYPES)
)
# The moments of a compact step, by the first moment's dtype: FP32, bf16, or 8-bit codes.
MOMENT_NAMES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16", torch.int8: "amp::Codes8"}


def compact_kernel(kernel, grad, master, moment):
    """The name of compact kernel `kernel` for a gradient dtype, a master (COMPACT, REMAINDER or
    its copy's dtype) and a moment dtype (MOMENT_NAMES)."""
    master_name = _MASTER_NAMES.get(master) or f"amp::Exact<{TYPE_NAMES[master]}>"
    return f"{kernel}<{TYPE_NAMES[grad]}, {master_name}, {MOMENT_NAMES[moment]}>"


_NAMES = (
    [f"amp_unscale<{TYPE_NAMES[t]}>" for t in TYPE_NAMES]
    + [f"amp_sum_squares<{TYPE_NAMES[t]}>" for t in TYPE_NAMES]
    + [
        f"{kernel}<{TYPE_NAMES[src]}, {TYPE_NAMES[dst]}>"
        for kernel in ("amp_scale_copy", "amp_scale_add")
        for src, dst in _layout.DTYPE_PAIRS
    ]
    + ["amp_norm_finalize"]
    + [f"amp_check<{TYPE_NAMES[t]}>" for t in TYPE_NAMES]
    + [
        f"{kernel}<{TYPE_NAMES[grad]}, {TYPE_NAMES[low]}>"
        for kernel in ("amp_adam", "amp_sgd")
        for grad, low in sorted(STEP_TYPES, key=str)
    ]
    + ["amp_count_steps"]
    + [
        compact_kernel(kernel, grad, master, moment)
        for kernel in ("amp_compact_adam", "amp_compact_sgd")
        for grad, master in sorted(COMPACT_MASTERS, key=str)
        for moment in MOMENT_NAMES
    ]
    + ["amp_compact_count_steps"]
)
SUPPORTED_PAIRS = frozenset(_layout.DTYPE_PAIRS)


class _Stream:
    """What CuPy's launch needs of a stream: its raw pointer."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class _Gpu:
    """Compiled kernels and launch constants for one GPU."""

    def __init__(self, index):
        properties = torch.cuda.get_device_properties(index)
        self.multiprocessors = properties.multi_processor_count
        compute_capability = properties.major * 10 + properties.minor
        forced = os.environ.get(PARAM_BYTES_ENV)
        if forced:
            self.parameter_bytes = int(forced)
        elif (
            cupy.cuda.runtime.driverGetVersion() >= 12010
            and compute_capability >= 70
            and nvrtc_version() >= (12, 1)
        ):
            self.parameter_bytes = _layout.PARAM_BYTES_LARGE
        else:
            self.parameter_bytes = _layout.PARAM_BYTES_SMALL
        self.capacity = {
            depth: _layout.max_tensors(depth, self.parameter_bytes) for depth in _layout.DEPTHS
        }
        self.module = cupy.RawModule(
            code=_SOURCE,
            options=("-std=c++17",) + _layout.compile_options(self.parameter_bytes),
            name_expressions=_NAMES,
        )
        with cupy.cuda.Device(index):
            self.functions = {name: self.module.get_function(name) for name in _NAMES}
            for function in self.functions.values():
                function.compile()
        self.max_grid = self.multiprocessors * 4  # one wave of 512-thread blocks; blocks loop


_gpus = {}
_streams = {}


def nvrtc_version():
    from cupy_backends.cuda.libs import nvrtc  # cupy.cuda.nvrtc is gone in CuPy 14

    return tuple(nvrtc.getVersion())


def on_gpu(index):
    """CuPy's context for GPU `index`."""
    return cupy.cuda.Device(index)


def gpu(index):
    device = _gpus.get(index)
    if device is None:
        device = _gpus[index] = _Gpu(index)
    return device


def stream(index):
    ptr = torch.cuda.current_stream(index).cuda_stream
    stream = _streams.get(ptr)
    if stream is None:
        stream = _streams[ptr] = _Stream(ptr)
    return stream


def check():
    """Compile for the current GPU; return a line saying what runs. Raises if CuPy cannot."""
    if not cupy.cuda.is_available():
        raise RuntimeError("cupy.cuda.is_available() is False")
    index = torch.cuda.current_device()
    device = gpu(index)
    return (
        f"CuPy {cupy.__version__}, NVRTC {'.'.join(map(str, nvrtc_version()))}, "
        f"{device.parameter_bytes}-byte kernel parameters "
        f"({device.capacity[1]} tensors per launch)"
    )


def launch(name, tensor_lists, arguments, first_chunk_argument=False):
    """Run kernel `name` over parallel lists of contiguous tensors on one device."""
    first = tensor_lists[0]
    index = first[0].device.index
    device = gpu(index)
    function = device.functions[name]
    pointers = [list(map(torch.Tensor.data_ptr, tensors)) for tensors in tensor_lists]
    numels = list(map(torch.Tensor.numel, first))
    launches = _layout.plan(pointers, numels, device.capacity[len(tensor_lists)])
    on = stream(index)
    with cupy.cuda.Device(index):
        for packed in launches:
            extra = (packed.first_chunk,) if first_chunk_argument else ()
            grid = (min(packed.chunks, device.max_grid),)
            function(
                grid,
                (_layout.BLOCK,),
                (packed.meta,) + arguments + extra + (_layout.CHUNK,),
                stream=on,
            )
    return launches


_dtype = operator.attrgetter("dtype")  # C-level reads: no Python call per tensor on the step
_is_contiguous = torch.Tensor.is_contiguous


def grouped(*lists):
    """{(dtype per list): indices} for the tensors the kernels take (indices None: all of them),
    and the indices of those they do not."""
    keys = list(zip(*[map(_dtype, tensors) for tensors in lists]))
    distinct = set(keys)
    if (
        len(distinct) == 1
        and set(keys[0]) <= TYPE_NAMES.keys()
        and all(map(_is_contiguous, itertools.chain.from_iterable(lists)))
    ):
        return {keys[0]: None}, []  # the step's case: one dtype per list, all contiguous
    ready = list(map(all, zip(*[map(_is_contiguous, tensors) for tensors in lists])))
    groups, rest = {}, []
    for index, key in enumerate(keys):
        if ready[index] and set(key) <= TYPE_NAMES.keys():
            groups.setdefault(key, []).append(index)
        else:
            rest.append(index)
    return groups, rest


def pick(values, indices):
    return values if indices is None else [values[i] for i in indices]


_plans = {}  # (kernel, launch key) -> (pointer rows, numels, launches), reused between steps
_PLANS_KEPT = 16


def planned(key, device, pointers, numels):
    """The launches over `pointers` (one row per list), kept from the last call with `key`
    while the tensors are the same: a row whose pointers changed (the gradients, at every step)
    is written into the packed launches again, and only a change of sizes packs anew."""
    cached = _plans.get(key)
    if cached is not None and cached[1] == numels:
        rows, _, launches = cached
        for row, (old, new) in enumerate(zip(rows, pointers)):
            if old != new:
                _write_row(launches, row, new, numels)
                rows[row] = new
        return launches
    launches = _layout.plan(pointers, numels, device.capacity[len(pointers)])
    if len(_plans) >= _PLANS_KEPT:
        del _plans[next(iter(_plans))]  # the oldest: lists of an optimizer no longer stepped
    _plans[key] = ([list(row) for row in pointers], list(numels), launches)
    return launches


def _write_row(launches, row, pointers, numels):
    kept = [pointer for pointer, numel in zip(pointers, numels) if numel > 0]
    start = 0
    for packed in launches:
        count = int(packed.meta[0]["ntensors"])
        packed.meta[0]["ptr"][row, :count] = kept[start : start + count]
        start += count


def run(name, launches, arguments, index, first_chunk_argument=False, chunked=True):
    """Launch kernel `name` once per packed launch, its Meta first, then `arguments` (and the
    launch's first chunk, and the chunk size where the kernel takes them)."""
    device = gpu(index)
    function = device.functions[name]
    on = stream(index)
    with cupy.cuda.Device(index):
        for packed in launches:
            extra = (packed.first_chunk,) if first_chunk_argument else ()
            extra += (_layout.CHUNK,) if chunked else ()
            function(
                (min(max(packed.chunks, 1), device.max_grid),),
                (_layout.BLOCK,),
                (packed.meta,) + arguments + extra,
                stream=on,
            )
