"""Launch metadata for multi_tensor.cu: numpy mirrors of its Meta structs, launch plans, and the
dtype pairs its copy kernels are instantiated for.

Importable without CUDA or CuPy, so the packing is tested on any machine.
"""

import numpy as np
import torch

__all__ = [
    "CHUNK",
    "BLOCK",
    "PARAM_BYTES_SMALL",
    "PARAM_BYTES_LARGE",
    "meta_dtype",
    "max_tensors",
    "DEPTHS",
    "compile_options",
    "Launch",
    "plan",
    "simulate",
    "DTYPE_PAIRS",
    "KERNEL_PARAMETERS",
]

CHUNK = 65536  # elements per chunk (a multiple of the 4-element vectors, so alignment holds)
BLOCK = 512  # threads per block (kBlock in the source)
PARAM_BYTES_SMALL = 4096  # the kernel-parameter limit of every GPU
PARAM_BYTES_LARGE = 32764  # with CUDA >= 12.1 on compute capability >= 7.0
# (source, destination) dtypes amp_scale_copy and amp_scale_add are instantiated for.
DTYPE_PAIRS = (
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
)
# Each kernel's Meta depth and the 8-byte parameters (pointers, doubles, long longs) it takes
# after its Meta, as the CUDA source declares them (tests/kernels/test_backends.py reads the
# source to check): a Meta<depth> gets the parameter bytes its widest kernel leaves.
KERNEL_PARAMETERS = {
    "amp_unscale": (1, 3),
    "amp_scale_copy": (2, 3),
    "amp_scale_add": (2, 3),
    "amp_sum_squares": (1, 3),
    "amp_check": (1, 4),
    "amp_adam": (6, 9),
    "amp_count_steps": (6, 1),
    "amp_sgd": (4, 8),
    "amp_compact_adam": (8, 10),
    "amp_compact_count_steps": (8, 1),
    "amp_compact_sgd": (6, 9),
}


def _other_parameter_bytes(depth):
    """The bytes the kernels taking a Meta<depth> pass beside it, at most."""
    return 8 * max(count for d, count in KERNEL_PARAMETERS.values() if d == depth)


def meta_dtype(depth, max_tensors):
    """The numpy layout of `amp::Meta<depth>` holding up to `max_tensors` tensors."""
    return np.dtype(
        [
            ("ptr", np.uint64, (depth, max_tensors)),
            ("numel", np.int64, (max_tensors,)),
            ("chunk_start", np.int32, (max_tensors + 1,)),
            ("ntensors", np.int32),
        ],
        align=True,
    )


def max_tensors(depth, parameter_bytes):
    """The most tensors a Meta<depth> can hold within the kernel-parameter limit, beside the
    other parameters of every kernel that takes it."""
    budget = parameter_bytes - _other_parameter_bytes(depth)
    count = budget // (8 * depth + 8 + 4)
    while meta_dtype(depth, count).itemsize > budget:
        count -= 1
    return count


DEPTHS = (1, 2, 4, 6, 8)  # the Meta structs multi_tensor.cu declares


def compile_options(parameter_bytes):
    """The -D options that size the source's Meta structs for `parameter_bytes`."""
    options = []
    for depth in DEPTHS:
        count = max_tensors(depth, parameter_bytes)
        options.append(f"-DAMP_MAX_TENSORS_D{depth}={count}")
        options.append(f"-DAMP_META_BYTES_D{depth}={meta_dtype(depth, count).itemsize}")
    return tuple(options)


class Launch:
    """One kernel launch: its Meta (a size-1 structured array, passed by value) and chunk count."""

    __slots__ = ("meta", "chunks", "first_chunk")

    def __init__(self, meta, chunks, first_chunk):
        self.meta = meta
        self.chunks = chunks
        self.first_chunk = first_chunk  # chunks of all earlier launches (for per-chunk outputs)


def plan(pointer_lists, numels, capacity, chunk=CHUNK):
    """Split parallel pointer lists into launches of at most `capacity` tensors.

    `pointer_lists` holds `depth` sequences of data pointers, `numels` the element counts.
    Empty tensors are left out (their pointers may be anything). Returns a list of Launch.
    """
    depth = len(pointer_lists)
    numels = np.asarray(numels, dtype=np.int64)
    keep = np.flatnonzero(numels > 0)
    pointers = np.asarray(pointer_lists, dtype=np.uint64).reshape(depth, -1)[:, keep]
    numels = numels[keep]
    chunks = (numels + (chunk - 1)) // chunk
    dtype = meta_dtype(depth, capacity)
    launches, first_chunk = [], 0
    for start in range(0, len(numels), capacity):
        stop = min(start + capacity, len(numels))
        count = stop - start
        meta = np.zeros(1, dtype=dtype)
        record = meta[0]
        record["ptr"][:, :count] = pointers[:, start:stop]
        record["numel"][:count] = numels[start:stop]
        starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(chunks[start:stop], out=starts[1:])
        if starts[-1] >= 2**31:
            raise ValueError("a launch would have 2**31 chunks or more; split the tensor list")
        record["chunk_start"][: count + 1] = starts
        record["ntensors"] = count
        launches.append(Launch(meta, int(starts[-1]), first_chunk))
        first_chunk += int(starts[-1])
    return launches


def simulate(launch, chunk=CHUNK):
    """The (tensor slot, first element, count) each chunk of `launch` covers, as the device does.

    A mirror of the kernel's index arithmetic (binary search over chunk_start) for tests.
    """
    record = launch.meta[0]
    count = int(record["ntensors"])
    starts = record["chunk_start"][: count + 1]
    covered = []
    for c in range(launch.chunks):
        lo, hi = 0, count - 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if starts[mid] <= c:
                lo = mid
            else:
                hi = mid - 1
        first = (c - int(starts[lo])) * chunk
        covered.append((lo, first, min(chunk, int(record["numel"][lo]) - first)))
    return covered
