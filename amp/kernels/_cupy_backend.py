"""The kernel functions as CuPy RawKernels (multi_tensor.cu) on torch's CUDA memory.

Tensors are passed as raw data pointers in a by-value Meta struct: no CuPy arrays, no DLPack, no
copies. Every launch goes to torch's current stream; nothing here synchronises with the host.
Tensors a kernel cannot take (non-contiguous, float64, ...) are handed to the torch backend.
"""

import itertools
import operator
import os
import pathlib

import cupy
import torch

from . import _layout, _torch_backend

PARAM_BYTES_ENV = "AMP_KERNEL_PARAM_BYTES"  # force the 4 KB layout on GPUs that allow 32 KB
_SOURCE = pathlib.Path(__file__).with_name("multi_tensor.cu").read_text()
_TYPE_NAMES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
]
_NAMES = (
    [f"amp_unscale<{_TYPE_NAMES[t]}>" for t in _TYPE_NAMES]
    + [f"amp_sum_squares<{_TYPE_NAMES[t]}>" for t in _TYPE_NAMES]
    + [
        f"{kernel}<{_TYPE_NAMES[src]}, {_TYPE_NAMES[dst]}>"
        for kernel in ("amp_scale_copy", "amp_scale_add")
        for src, dst in _PAIRS
    ]
    + ["amp_norm_finalize"]
)
_SUPPORTED_PAIRS = frozenset(_PAIRS)


class _Stream:
    """What CuPy's launch needs of a stream: its raw pointer."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class _Device:
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
            depth: _layout.max_tensors(depth, self.parameter_bytes) for depth in (1, 2)
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


_devices = {}
_streams = {}


def nvrtc_version():
    from cupy_backends.cuda.libs import nvrtc  # cupy.cuda.nvrtc is gone in CuPy 14

    return tuple(nvrtc.getVersion())


def _device(index):
    device = _devices.get(index)
    if device is None:
        device = _devices[index] = _Device(index)
    return device


def _stream(index):
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
    device = _device(index)
    return (
        f"CuPy {cupy.__version__}, NVRTC {'.'.join(map(str, nvrtc_version()))}, "
        f"{device.parameter_bytes}-byte kernel parameters "
        f"({device.capacity[1]} tensors per launch)"
    )


def _launch(name, tensor_lists, arguments, first_chunk_argument=False):
    """Run kernel `name` over parallel lists of contiguous tensors on one device."""
    first = tensor_lists[0]
    index = first[0].device.index
    device = _device(index)
    function = device.functions[name]
    pointers = [list(map(torch.Tensor.data_ptr, tensors)) for tensors in tensor_lists]
    numels = list(map(torch.Tensor.numel, first))
    launches = _layout.plan(pointers, numels, device.capacity[len(tensor_lists)])
    stream = _stream(index)
    with cupy.cuda.Device(index):
        for launch in launches:
            extra = (launch.first_chunk,) if first_chunk_argument else ()
            grid = (min(launch.chunks, device.max_grid),)
            function(
                grid,
                (_layout.BLOCK,),
                (launch.meta,) + arguments + extra + (_layout.CHUNK,),
                stream=stream,
            )
    return launches


_dtype = operator.attrgetter("dtype")  # C-level reads: no Python call per tensor on the step
_is_contiguous = torch.Tensor.is_contiguous


def _grouped(*lists):
    """{(dtype per list): indices} for the tensors the kernels take (indices None: all of them),
    and the indices of those they do not."""
    keys = list(zip(*[map(_dtype, tensors) for tensors in lists]))
    distinct = set(keys)
    if (
        len(distinct) == 1
        and set(keys[0]) <= _TYPE_NAMES.keys()
        and all(map(_is_contiguous, itertools.chain.from_iterable(lists)))
    ):
        return {keys[0]: None}, []  # the step's case: one dtype per list, all contiguous
    ready = list(map(all, zip(*[map(_is_contiguous, tensors) for tensors in lists])))
    groups, rest = {}, []
    for index, key in enumerate(keys):
        if ready[index] and set(key) <= _TYPE_NAMES.keys():
            groups.setdefault(key, []).append(index)
        else:
            rest.append(index)
    return groups, rest


def _pick(values, indices):
    return values if indices is None else [values[i] for i in indices]


def unscale_(tensors, inv_scale, found_inf):
    groups, rest = _grouped(tensors)
    for (dtype,), indices in groups.items():
        _launch(
            f"amp_unscale<{_TYPE_NAMES[dtype]}>",
            [_pick(tensors, indices)],
            (inv_scale.data_ptr(), found_inf.data_ptr()),
        )
    if rest:
        _torch_backend.unscale_(_pick(tensors, rest), inv_scale, found_inf)


def _pairwise(kernel, torch_fallback, sources, destinations, scale, found_inf):
    groups, rest = _grouped(sources, destinations)
    for pair, indices in groups.items():
        if pair not in _SUPPORTED_PAIRS:
            rest.extend(range(len(sources)) if indices is None else indices)
            continue
        _launch(
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


def unscale_to_(sources, destinations, inv_scale, found_inf):
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
    _launch(
        f"amp_sum_squares<{_TYPE_NAMES[dtype]}>",
        [chosen],
        (partial.data_ptr(),),
        first_chunk_argument=True,
    )
    index = device.index
    with cupy.cuda.Device(index):
        _device(index).functions["amp_norm_finalize"](
            (1,),
            (_layout.BLOCK,),
            (partial.data_ptr(), total, out.data_ptr()),
            stream=_stream(index),
        )
    return out
