"""The CuPy side of the kernels: the compiled module per GPU, torch's current stream, and the
launches (one Meta struct by value per launch, amp/kernels/_layout.py), packed anew or kept while
the tensors stay the same.
"""

import itertools
import operator
import os
import time

import cupy
import torch

from . import _layout, _sources

__all__ = [
    "PARAM_BYTES_ENV",
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
SUPPORTED_PAIRS = frozenset(_layout.DTYPE_PAIRS)


class _Stream:
    """What CuPy's launch needs of a stream: its raw pointer."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class _Functions(dict):
    """A GPU's kernels by name: a name not yet here compiles its whole family (one RawModule,
    amp/kernels/_sources.py), so a run compiles what it launches when it first launches it and
    a lookup afterwards is a dict's."""

    def __init__(self, gpu):
        super().__init__()
        self._gpu = gpu

    def __missing__(self, name):
        family = _sources.family_of(name)
        self._gpu.compile(family, (name,) if _sources.FAMILIES[family].per_kernel else None)
        return self[name]


class _Gpu:
    """The kernels and launch constants of one GPU."""

    def __init__(self, index):
        self.index = index
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
        self.options = (
            ("-std=c++17",) + _layout.compile_options(self.parameter_bytes) + _sources.GPU_OPTIONS
        )
        self.functions = _Functions(self)
        self.compile_seconds = {}  # family (or kernel) -> seconds to compile and load its module
        self.max_grid = self.multiprocessors * 4  # one wave of 512-thread blocks; blocks loop

    def compile(self, family, names=None):
        """Compile and load kernels `names` of `family` (a key of _sources.FAMILIES; None: all
        of them) for this GPU, as one module."""
        begin = time.perf_counter()
        names = names or _sources.FAMILIES[family].names
        module = cupy.RawModule(
            code=_sources.source((family,)), options=self.options, name_expressions=names
        )
        with cupy.cuda.Device(self.index):
            for name in names:
                function = self.functions[name] = module.get_function(name)
                function.compile()
        self.compile_seconds[names[0] if len(names) == 1 else family] = (
            time.perf_counter() - begin
        )


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
    """Compile the smallest family (unscale and check: what an O1 run launches) for the current
    GPU; return a line saying what runs. Raises if CuPy or NVRTC cannot: the other families
    compile when a run first launches one of their kernels."""
    if not cupy.cuda.is_available():
        raise RuntimeError("cupy.cuda.is_available() is False")
    index = torch.cuda.current_device()
    device = gpu(index)
    if "unscale" not in device.compile_seconds:
        device.compile("unscale")
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
        and set(keys[0]) <= _sources.TYPE_NAMES.keys()
        and all(map(_is_contiguous, itertools.chain.from_iterable(lists)))
    ):
        return {keys[0]: None}, []  # the step's case: one dtype per list, all contiguous
    ready = list(map(all, zip(*[map(_is_contiguous, tensors) for tensors in lists])))
    groups, rest = {}, []
    for index, key in enumerate(keys):
        if ready[index] and set(key) <= _sources.TYPE_NAMES.keys():
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


def run(name, launches, arguments, index, first_chunk_argument=False, chunked=True, rows=False):
    """Launch kernel `name` once per packed launch, its Meta first, then `arguments` (and the
    launch's first chunk, the address of its tensors' values in `rows` (an int64 device tensor
    of a value per tensor of all the launches; None: a null pointer) and the chunk size where
    the kernel takes them: `rows` False where it takes no such address)."""
    device = gpu(index)
    function = device.functions[name]
    on = stream(index)
    done = 0  # the tensors of the launches before
    with cupy.cuda.Device(index):
        for packed in launches:
            extra = (packed.first_chunk,) if first_chunk_argument else ()
            if rows is not False:
                extra += (0 if rows is None else rows.data_ptr() + 8 * done,)
                done += int(packed.meta[0]["ntensors"])
            extra += (_layout.CHUNK,) if chunked else ()
            function(
                (min(max(packed.chunks, 1), device.max_grid),),
                (_layout.BLOCK,),
                (packed.meta,) + arguments + extra,
                stream=on,
            )
