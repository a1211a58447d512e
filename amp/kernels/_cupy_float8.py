"""The CuPy side of the FP8 casts: the RawModule of their source (_sources.FLOAT8_FILES) for each
GPU (compiled at the first cast there), and the launches on torch's current stream (their Metas:
_float8_layout.py).

amp/kernels/float8.py allocates the outputs and zeroes the amaxes; this module only launches.
"""

from typing import Sequence

import cupy
import torch

from . import _cupy_device, _float8_layout, _sources

__all__ = ["gpu", "cast", "scale_outer_"]

_SOURCE = _sources.float8_source()
_THREADS = _float8_layout.THREADS
_BLOCKS_PER_MULTIPROCESSOR = 8  # then the blocks loop over the tiles
_TYPE_NAMES = _sources.TYPE_NAMES
_FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_NAMES = (
    [f"amp_f8_amax<{name}>" for name in _TYPE_NAMES.values()]
    + [f"amp_f8_cast<{name}, {f}>" for name in _TYPE_NAMES.values() for f in _FORMATS.values()]
    + ["amp_f8_scale_outer"]
)


class _Gpu:
    """The FP8 casts' source compiled for one GPU, and its launch constants."""

    def __init__(self, index):
        self.max_grid = (
            torch.cuda.get_device_properties(index).multi_processor_count
            * _BLOCKS_PER_MULTIPROCESSOR
        )
        module = cupy.RawModule(
            code=_SOURCE,
            options=("-std=c++17",) + _float8_layout.compile_options(),
            name_expressions=_NAMES,
        )
        with cupy.cuda.Device(index):
            self.functions = {name: module.get_function(name) for name in _NAMES}
            for function in self.functions.values():
                function.compile()


_gpus = {}


def gpu(index: int) -> _Gpu:
    """The FP8 casts' module for GPU `index`, compiled at the first call."""
    device = _gpus.get(index)
    if device is None:
        device = _gpus[index] = _Gpu(index)
    return device


def cast(jobs: Sequence, float8_dtype: torch.dtype, power_of_2: bool) -> None:
    """The amaxes, then the layouts and scales, of `jobs` (amp/kernels/float8.py's Job: one
    input dtype, one device, none empty): two launches per _float8_layout.JOBS jobs."""
    source = jobs[0].src
    index = source.device.index
    device = gpu(index)
    type_name = _TYPE_NAMES[source.dtype]
    amax = device.functions[f"amp_f8_amax<{type_name}>"]
    write = device.functions[f"amp_f8_cast<{type_name}, {_FORMATS[float8_dtype]}>"]
    metas = _float8_layout.metas(jobs)
    on = _cupy_device.stream(index)
    with cupy.cuda.Device(index):
        for meta, count in metas:  # every amax before the first cast that reads one
            amax((min(count, device.max_grid),), (_THREADS,), (meta,), stream=on)
        for meta, count in metas:
            write((min(count, device.max_grid),), (_THREADS,), (meta, int(power_of_2)), stream=on)


def scale_outer_(out: torch.Tensor, row_inverse: torch.Tensor, col_inverse: torch.Tensor) -> None:
    """out (bf16, 2-D, contiguous) *= row_inverse[r] * col_inverse[c] (float32, contiguous)."""
    rows, cols = out.shape
    index = out.device.index
    device = gpu(index)
    items = rows * -(-cols // (8 * _THREADS))
    with cupy.cuda.Device(index):
        device.functions["amp_f8_scale_outer"](
            (min(items, device.max_grid),),
            (_THREADS,),
            (out.data_ptr(), rows, cols, row_inverse.data_ptr(), col_inverse.data_ptr()),
            stream=_cupy_device.stream(index),
        )
