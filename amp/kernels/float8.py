"""The device work of amp's FP8 linears: casts to FP8 with dynamic scales, and the scaled matmul.

`cast` makes a matrix's FP8 layouts, row-major and transposed, each scaled per tensor, per row
or per column: on CUDA tensors outside torch.compile by the float8*.cu kernels where CuPy can run
them (one read for the amaxes, one read that writes every layout asked for; many matrices in
one launch), else by torch operations (_torch_float8.py); the same bits either way. `matmul`
runs torch._scaled_mm as torchao.float8 does, with the rowwise recipe's output scaling in one
kernel where the casts have theirs.
"""

import logging
from typing import List, Optional, Sequence

import torch

from . import _torch_float8
from ._torch_float8 import COLUMN, EPS, ROW, TENSOR, Float8Cast, amax_to_scale, to_float8

__all__ = [
    "EPS",
    "TENSOR",
    "ROW",
    "COLUMN",
    "Float8Cast",
    "amax_to_scale",
    "to_float8",
    "Job",
    "cast",
    "matmul",
    "scale_outer_",
]

logger = logging.getLogger("amp")
_compiling = torch.compiler.is_compiling
_WIDE = (torch.float16, torch.float32)  # rowwise outputs _scaled_mm makes in bf16 first


class Job:
    """What the float8*.cu kernels are given for one matrix (_float8_layout.py packs it): `src`
    (2-D, contiguous, not empty), the layouts to write (`out`, `out_t`: FP8 tensors or None),
    their amaxes (int32 tensors of float bits, zeroed: one value, or one per row / per column;
    the same tensor for both layouts where both are per tensor), and the float32 tensors their
    scales and inverses go to."""

    __slots__ = ("src", "out", "out_t", "amax", "amax_t", "scale", "inverse", "scale_t",
                 "inverse_t", "per_row", "per_col")

    def __init__(self, src, out, out_t, amax, amax_t, scale, inverse, scale_t, inverse_t,
                 per_row, per_col):
        self.src, self.out, self.out_t = src, out, out_t
        self.amax, self.amax_t = amax, amax_t
        self.scale, self.inverse, self.scale_t, self.inverse_t = scale, inverse, scale_t, inverse_t
        self.per_row, self.per_col = per_row, per_col


_MISSING = object()
_modules = {}  # GPU index -> _cupy_float8 once float8*.cu runs there, or None when it cannot


def _load(index):
    from . import cuda_backend

    if cuda_backend().name != "cupy":
        return None
    try:
        from . import _cupy_float8

        _cupy_float8.gpu(index)  # compiles float8*.cu for the GPU
        return _cupy_float8
    except Exception as error:  # CuPy, NVRTC or the driver: the torch operations serve
        logger.warning(
            "amp: FP8 casts run on torch operations: float8.cu cannot be used on cuda:%s (%s: %s)",
            index, type(error).__name__, error,
        )
        return None


def _cupy_for(tensor: torch.Tensor):
    """_cupy_float8 where its kernels take `tensor` (CUDA, eager), else None."""
    if tensor.device.type != "cuda" or _compiling():
        return None
    index = tensor.device.index
    module = _modules.get(index, _MISSING)
    if module is _MISSING:
        module = _modules[index] = _load(index)
    return module


def _numbers(matrix, layout):
    """How many amaxes and scales a layout scaled by `layout` needs (0: not made)."""
    if layout is None:
        return 0
    return 1 if layout == TENSOR else matrix.shape[0 if layout == ROW else 1]


def _jobs(matrices, float8_dtype, row_major, transposed):
    """(Jobs, Float8Casts) over one zeroed amax buffer and one scale buffer for all matrices."""
    shared = row_major == TENSOR and transposed == TENSOR
    counts = [(_numbers(m, row_major), 0 if shared else _numbers(m, transposed)) for m in matrices]
    total = sum(a + b for a, b in counts)
    device = matrices[0].device
    amaxes = torch.zeros(total, dtype=torch.int32, device=device)
    scales = torch.empty(2 * total, dtype=torch.float32, device=device)
    jobs, casts, at = [], [], 0

    def take(count, layout):
        nonlocal at
        if count == 0:
            return None, None, None
        pieces = (amaxes[at : at + count], scales[at : at + count],
                  scales[total + at : total + at + count])
        at += count
        if layout == TENSOR:
            return pieces[0], pieces[1][0], pieces[2][0]
        return pieces[0], pieces[1].view(count, 1), pieces[2].view(count, 1)

    for matrix, (count, count_t) in zip(matrices, counts):
        rows, cols = matrix.shape
        result = Float8Cast()
        amax, result.scale, result.inverse = take(count, row_major)
        amax_t, result.scale_t, result.inverse_t = take(count_t, transposed)
        if shared:
            amax_t, result.scale_t, result.inverse_t = amax, result.scale, result.inverse
        if row_major is not None:
            result.data = torch.empty((rows, cols), dtype=float8_dtype, device=device)
        if transposed is not None:
            result.data_t = torch.empty((cols, rows), dtype=float8_dtype, device=device)
        jobs.append(Job(matrix, result.data, result.data_t, amax, amax_t, result.scale,
                        result.inverse, result.scale_t, result.inverse_t, row_major == ROW,
                        transposed == COLUMN))
        casts.append(result)
    return jobs, casts


def cast(
    matrices: Sequence[torch.Tensor],
    float8_dtype: torch.dtype,
    row_major: Optional[str],
    transposed: Optional[str],
    power_of_2: bool,
) -> List[Float8Cast]:
    """The Float8Cast of each 2-D matrix (one device): `data` scaled as `row_major` says (TENSOR,
    ROW, or None: not made), `data_t` as `transposed` says (TENSOR, COLUMN or None), scales
    rounded down to powers of 2 where `power_of_2`. torchao's numerics (_torch_float8.to_float8),
    bit for bit on every path."""
    if not matrices:
        return []
    cupy = _cupy_for(matrices[0])
    if cupy is None:
        return [
            _torch_float8.cast(m, float8_dtype, row_major, transposed, power_of_2) for m in matrices
        ]
    results = [None] * len(matrices)
    groups = {}
    for position, matrix in enumerate(matrices):
        if matrix.numel() == 0:  # no tile: the torch operations make its scales
            results[position] = _torch_float8.cast(
                matrix, float8_dtype, row_major, transposed, power_of_2
            )
        else:
            groups.setdefault(matrix.dtype, []).append(position)
    for positions in groups.values():  # one kernel per input dtype
        jobs, casts = _jobs(
            [matrices[p].contiguous() for p in positions], float8_dtype, row_major, transposed
        )
        cupy.cast(jobs, float8_dtype, power_of_2)
        for position, result in zip(positions, casts):
            results[position] = result
    return results


def scale_outer_(out: torch.Tensor, row_inverse: torch.Tensor, col_inverse: torch.Tensor) -> None:
    """out *= row_inverse * col_inverse ((rows, 1) and (1, cols)), the product rounded to FP32
    first: in one kernel for a bf16 matrix where the casts run on CuPy (torch's operations make
    the rows x cols FP32 product first)."""
    cupy = _cupy_for(out)
    if (
        cupy is None
        or out.dtype is not torch.bfloat16
        or out.numel() == 0
        or not (out.is_contiguous() and row_inverse.is_contiguous() and col_inverse.is_contiguous())
    ):
        _torch_float8.scale_outer_(out, row_inverse, col_inverse)
        return
    cupy.scale_outer_(out, row_inverse, col_inverse)


def matmul(
    a: torch.Tensor,
    a_inverse: torch.Tensor,
    b: torch.Tensor,
    b_inverse: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """`(a * a_inverse) @ (b * b_inverse)` in `out_dtype` by `torch._scaled_mm`, as torchao's
    `addmm_float8_unwrapped` runs it: `a` row-major and `b` column-major (cuBLASLt takes no other
    layout); rowwise inverses ((rows of a, 1), (1, columns of b)) without fast accumulation
    applied after a matmul with unit scales (torchao finds CUTLASS's rowwise kernel too slow
    without it); rowwise results made in bfloat16 when float32 or float16 is asked (`_scaled_mm`
    has no rowwise float32 output) and cast after."""
    rowwise = a_inverse.shape == (a.shape[0], 1) and b_inverse.shape == (1, b.shape[1])
    outer = rowwise and not fast_accum
    if outer:
        row_inverse, col_inverse = a_inverse, b_inverse
        a_inverse = b_inverse = a_inverse.new_ones(())
    mm_dtype = torch.bfloat16 if rowwise and out_dtype in _WIDE else out_dtype
    out = torch._scaled_mm(
        a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=mm_dtype, use_fast_accum=fast_accum
    )
    if outer:
        scale_outer_(out, row_inverse, col_inverse)
    if mm_dtype is not out_dtype:
        out = out.to(out_dtype)
    return out
